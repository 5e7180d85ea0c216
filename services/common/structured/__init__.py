"""Structured outputs' grammars, shared by admission, the in-process engine and the worker:
the one rule for what a format means (``grammar.py``), what a grammar engine provides
(``grammar_engine.py``), the two engines (``grammar_llguidance.py``,
``grammar_xgrammar.py``) and tool calls as a format (``tool_format.py``, written for
llguidance by ``grammar_llguidance_tools.py``).

May import ``messages`` and ``services.common``; no service.
"""
