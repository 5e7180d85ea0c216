"""The worker shard: runs one scheduler's batches on the model, strictly in seq order.

- ``service.py`` (the NATS actor), ``batch_queue.py`` (batches in seq order), ``compute.py``
  (the job runner) and ``runner_host.py`` (the model and the runner over one KV geometry);
- the two backends of the row protocol: ``runner.py`` (``ModelRunner``, tensors) and
  ``sim.py`` (``SimRunner``, a cost model, ``--device sim``);
- ``model/``: the Ouro model and its checkpoints; ``passes/``: one batch as core passes (rows,
  the plan, flat inputs, static decode, host-device copies, sparse prefill); ``sampling/``:
  grammars and log-probabilities; ``kv_transfer/``: KV pulled between workers (NIXL);
  ``telemetry.py``: metrics and spans.

May import ``messages``, ``kernels``, ``services.common`` and ``services.runtime``; never
another service.
"""
