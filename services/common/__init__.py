"""What several services share: the model's config and limits (``model_config.py``,
``checkpoint.py``, ``generation_config.py``), the scheduler's config (``config.py``), the
request-fit rule (``fit.py``), sampling and the exit policy, token-sparse prefill's schedule,
the tokenizer and detokenizer, what a chat template does with tools (``tool_template.py``),
structured outputs' grammars (``structured/``) and the shared
flags (``flags.py``, ``service_flags.py``).

May import ``messages``, ``kernels`` and ``services.runtime``; never a service.
"""
