"""One batch as core passes, the runner's parts: the row protocol every backend follows
(``rows.py``), what a pass runs (``pass_plan.py``) and its flat inputs (``pass_inputs.py``),
decode passes with static shapes for CUDA graphs (``static_decode.py``, ``decode_pool.py``),
every host-device copy (``transfer.py``) and token-sparse prefill (``sparse_prefill.py``).

May import ``messages``, ``kernels``, ``services.common`` and ``services.worker.model``; not
the runner, the shell, ``sampling/`` or ``kv_transfer/``.
"""
