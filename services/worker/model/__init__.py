"""The Ouro model (``ouro.py``, over ``kernels/ops/``), its strict checkpoint loader
(``loader.py``), the toy checkpoint (``toy.py``) and the checkpoint sizes ``rlt`` knows
(``sizes.py``).

May import ``kernels`` and ``services.common``; nothing else of the worker.
"""
