"""What a chat or completion's output is held to, as the gateway translates it: OpenAI's
``response_format`` and vLLM's ``structured_outputs`` (``structured.py``), ``tools`` and
``tool_choice`` (``tools.py``), and the parser that turns a constrained output back into
``tool_calls`` (``tool_parser.py``). Imports messages/, services.common and the gateway's
own modules only.
"""
