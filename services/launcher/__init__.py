"""Running the services: ``rlt up`` (``up.py``), ``rlt service NAME`` (``service.py``), the
online ``rlt generate`` (``generate.py``), each reading its flags once into ``settings.py``.
``nats_servers.py`` runs nats-server; ``build.py`` builds the services, as objects or as
child processes; ``processes.py`` and ``probes.py`` start and watch them from outside (the
soak and fuzz scripts and the reliability tests).

What other packages use is re-exported here.
"""

from services.launcher.build import build_service, build_services, service_processes
from services.launcher.nats_servers import NatsCluster, NatsServer, find_nats_server, free_port

__all__ = [
    "NatsCluster",
    "NatsServer",
    "build_service",
    "build_services",
    "find_nats_server",
    "free_port",
    "service_processes",
]
