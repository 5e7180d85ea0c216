"""The HTTP gateway: the OpenAI-compatible API (``app.py``, ``protocol.py``, ``translate.py``,
``call.py``, ``stream.py``, ``responses.py``), tool calling (``tools.py``, ``tool_parser.py``),
API keys and the bounded edge (``auth.py``,
``edge.py``), ``/metrics``, and its NATS client of admission (``service.py``).

May import ``messages``, ``services.common`` and ``services.runtime``; never another service.
"""
