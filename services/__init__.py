"""rlt's services and the code they share, one package each (docs/ARCHITECTURE.md, "Rooms").

Dependencies point down: ``cli.py`` -> ``launcher/``, ``bench/`` -> the services' shells
(``admission/``, ``scheduler/``, ``worker/``, ``prefix_cache/``, ``gateway/``) -> ``engine/``
-> the scheduler's and worker's cores -> ``common/``, ``runtime/``, ``messages``, ``kernels``.
No service imports another's internals, and nothing imports the CLI (pyproject's contracts).
"""
