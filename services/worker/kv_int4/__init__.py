"""int4-delta KV in the worker: coded blocks, full-precision tails, sealing and the pass's
attention over both (docs/kv_codecs.md, "In the engine")."""
