"""What the worker adds around the sampler (``services/common/sampling.py``): structured
outputs' grammars and token masks (``grammar.py``) and log-probabilities (``logprobs.py``).

May import ``messages``, ``services.common`` and, for types, ``passes/`` and ``model/``.
"""
