"""Who may publish and subscribe where: the one permission model behind both NATS configs.

``deploy/nats.conf`` (compose; passwords from the environment) is generated from it
(``python -m services.runtime.permissions > deploy/nats.conf``; a test keeps the file and
the model equal), and ``rlt up`` renders the same model with random passwords per run.
Subject names come from ``subjects.py``; what each role may do with them is here and only
here. docs/services.md ("Security model") explains the roles.

Rules the model keeps:
- an internal subject is publishable only by the service that owns it (admission submits,
  the scheduler sends batches and stream events, the worker sends results);
- clients publish only their tenant's request subjects and read only their tenant's inboxes;
- JetStream API access is scoped to the two stores (the prefix-event stream and the
  snapshot object store), and only for the services that use them.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from services.runtime import subjects
from services.runtime.bus import with_credentials
from services.runtime.jetstream import EVENT_STREAM, SNAPSHOT_BUCKET

_OBJ = f"OBJ_{SNAPSHOT_BUCKET}"


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    subscribe_deny: tuple[str, ...] = ()


def _own_inbox(service: str) -> str:
    return f"{subjects.service_inbox(subjects.micro_name(service))}.>"


# streams go to every client inbox root; services answer each other's requests in
# _RLT_INBOX; micro discovery replies ($SRV.PING) go to the asker's inbox
_CLIENT_INBOXES = tuple(f"{root}.>" for root in subjects.DEFAULT_INBOX_ROOTS)
_EVENT_STREAM_ADMIN = (
    f"$JS.API.STREAM.INFO.{EVENT_STREAM}",
    f"$JS.API.STREAM.CREATE.{EVENT_STREAM}",
    f"$JS.API.STREAM.UPDATE.{EVENT_STREAM}",
)

SERVICE_ROLES: dict[str, Permissions] = {
    "admission": Permissions(
        publish=(
            f"{subjects.SCHED_SUBMIT}.>",  # per shard
            subjects.SCHED_ABORT,  # every shard (the request's shard is not known here)
            f"{subjects.SCHED_ABORT}.>",  # one shard
            subjects.SCHED_LOAD_GET,
            subjects.SHARD_DISCOVER,
            subjects.SCHED_ALIVE_ALL,
            subjects.PREFIX_LOOKUP,
            # a handoff no decode shard will read (its request ended during the handover)
            f"{subjects.SCHED_KV_RELEASE}.>",
            *_CLIENT_INBOXES,
            _own_inbox("admission"),
            # answers to a scheduler's fence query (its request inbox)
            _own_inbox("scheduler"),
            "$SRV.PING.>",
        ),
        subscribe=(
            subjects.GENERATE,
            subjects.ABORT,
            subjects.TENANT_GENERATE_ALL,
            subjects.TENANT_ABORT_ALL,
            subjects.SCHED_LOAD,
            subjects.SHARD_ANNOUNCE,
            f"{subjects.ADMISSION_TRACK_PREFIX}.>",
            subjects.health("admission"),
            "$SRV.>",
            _own_inbox("admission"),
        ),
    ),
    "scheduler": Permissions(
        publish=(
            f"{subjects.WORKER_BATCH}.>",
            f"{subjects.WORKER_DISCOVER}.>",
            subjects.SCHED_LOAD,
            subjects.SHARD_ANNOUNCE,
            f"{subjects.PREFIX_EVENTS}.>",
            f"{subjects.ADMISSION_TRACK_PREFIX}.>",
            f"{subjects.SCHED_KV_RELEASE}.>",  # a decode shard done with a handoff
            f"{subjects.WORKER_KV_ACK}.>",  # its worker's pull results received
            subjects.metrics("scheduler"),
            *_CLIENT_INBOXES,
            f"{subjects.SERVICE_INBOX_PREFIX}.>",
            "$SRV.PING.>",
            # create / bring up to date the prefix-event stream
            *_EVENT_STREAM_ADMIN,
        ),
        subscribe=(
            f"{subjects.SCHED_SUBMIT}.>",
            subjects.SCHED_ABORT,
            f"{subjects.SCHED_ABORT}.>",
            subjects.SCHED_LOAD_GET,
            subjects.SCHED_ALIVE_ALL,
            subjects.SHARD_DISCOVER,
            f"{subjects.WORKER_HEARTBEAT}.>",
            f"{subjects.WORKER_RESULT}.>",
            f"{subjects.SCHED_KV_RELEASE}.>",
            subjects.health("scheduler"),
            f"{subjects.health('scheduler')}.>",  # one shard's scheduler
            "$SRV.>",
            _own_inbox("scheduler"),
        ),
    ),
    "worker": Permissions(
        publish=(
            f"{subjects.WORKER_RESULT}.>",
            f"{subjects.WORKER_HEARTBEAT}.>",
            subjects.metrics("worker"),
            # "is the scheduler I am bound to still there?" before another may take over
            subjects.SCHED_ALIVE_ALL,
            f"{subjects.WORKER_KV_META}.>",  # where a prefill worker's KV is (decode role)
            *_CLIENT_INBOXES,
            _own_inbox("worker"),
            "$SRV.PING.>",
        ),
        subscribe=(
            f"{subjects.WORKER_BATCH}.>",
            f"{subjects.WORKER_DISCOVER}.>",
            f"{subjects.WORKER_KV_META}.>",
            f"{subjects.WORKER_KV_ACK}.>",
            subjects.health("worker"),
            f"{subjects.health('worker')}.>",  # one shard's worker
            "$SRV.>",
            _own_inbox("worker"),
        ),
    ),
    # the HTTP gateway is a client of the public API with its own stream inboxes, pings the
    # services /health needs, and reads every service's metrics
    "gateway": Permissions(
        publish=(
            subjects.GENERATE,
            subjects.ABORT,
            subjects.health("admission"),
            subjects.health("scheduler"),
            subjects.health("worker"),
            _own_inbox("gateway"),
            "$SRV.PING.>",
        ),
        subscribe=(
            f"{subjects.GATEWAY_INBOX_PREFIX}.>",
            subjects.METRICS_ALL,
            subjects.health("gateway"),
            "$SRV.>",
            _own_inbox("gateway"),
        ),
    ),
    "prefix-cache": Permissions(
        publish=(
            *_CLIENT_INBOXES,
            f"{subjects.SERVICE_INBOX_PREFIX}.>",
            "$SRV.PING.>",
            *_EVENT_STREAM_ADMIN,
            # its durable consumer on the event stream: create, read, ack
            f"$JS.API.CONSUMER.CREATE.{EVENT_STREAM}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{EVENT_STREAM}.>",
            f"$JS.API.CONSUMER.DELETE.{EVENT_STREAM}.>",
            f"$JS.API.CONSUMER.INFO.{EVENT_STREAM}.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{EVENT_STREAM}.>",
            f"$JS.ACK.{EVENT_STREAM}.>",
            # its snapshots in the object store
            f"$JS.API.STREAM.INFO.{_OBJ}",
            f"$JS.API.STREAM.CREATE.{_OBJ}",
            f"$JS.API.STREAM.UPDATE.{_OBJ}",
            f"$JS.API.STREAM.PURGE.{_OBJ}",
            f"$JS.API.STREAM.MSG.GET.{_OBJ}",
            f"$JS.API.DIRECT.GET.{_OBJ}.>",
            f"$JS.API.CONSUMER.CREATE.{_OBJ}",
            f"$JS.API.CONSUMER.CREATE.{_OBJ}.>",
            f"$JS.API.CONSUMER.DELETE.{_OBJ}.>",
            f"$O.{SNAPSHOT_BUCKET}.>",
            "$JS.FC.>",
        ),
        subscribe=(
            subjects.PREFIX_LOOKUP,
            subjects.SCHED_LOAD,  # which producers are alive (their shards' load reports)
            subjects.health("prefix-cache"),
            "$SRV.>",
            _own_inbox("prefix-cache"),
        ),
    ),
}


def client_permissions(tenant: str = subjects.DEFAULT_TENANT) -> Permissions:
    """A tenant's clients: its two request subjects and its own inboxes, nothing internal.
    The default tenant's clients may not read any named tenant's inboxes."""
    publish = (subjects.tenant_generate(tenant), subjects.tenant_abort(tenant))
    if tenant == subjects.DEFAULT_TENANT:
        return Permissions(  # _INBOX only: other inbox roots belong to front ends
            publish=publish,
            subscribe=(f"{subjects.CLIENT_INBOX_ROOT}.>",),
            subscribe_deny=(f"{subjects.TENANT_INBOX_ROOT}.>",),
        )
    return Permissions(publish=publish, subscribe=(f"{subjects.tenant_inbox(tenant)}.>",))


@dataclass(frozen=True)
class User:
    """One NATS user. ``password`` is a literal, or ``$NAME`` for nats-server to read from
    the environment. ``permissions`` None: everything (the operator)."""

    name: str
    password: str
    permissions: Permissions | None

    @property
    def role(self) -> str:
        """The permission block's name in the config: ``tenant-acme`` -> ``TENANT_ACME``."""
        return self.name.upper().replace("-", "_")


def client_user_name(tenant: str = subjects.DEFAULT_TENANT) -> str:
    return "client" if tenant == subjects.DEFAULT_TENANT else f"tenant-{tenant}"


def password_var(user: str) -> str:
    """The environment variable deploy/nats.conf reads a user's password from."""
    return f"RLT_NATS_{user.upper().replace('-', '_')}_PASSWORD"


def users(
    passwords: dict[str, str], tenants: Sequence[str] = (), operator: bool = True
) -> list[User]:
    """The services, the default tenant's clients, each named tenant, the operator.
    ``passwords`` maps user names to literals or ``$VAR``s."""
    out = [User(name, passwords[name], perms) for name, perms in SERVICE_ROLES.items()]
    for tenant in (subjects.DEFAULT_TENANT, *tenants):
        name = client_user_name(tenant)
        out.append(User(name, passwords[name], client_permissions(tenant)))
    if operator:
        out.append(User("operator", passwords["operator"], None))
    return out


def all_user_names(tenants: Sequence[str] = ()) -> list[str]:
    return [
        *SERVICE_ROLES,
        *(client_user_name(t) for t in (subjects.DEFAULT_TENANT, *tenants)),
        "operator",
    ]


def random_passwords(names: Iterable[str]) -> dict[str, str]:
    return {name: secrets.token_urlsafe(24) for name in names}


# ---------------------------------------------------------------------- rendering
@dataclass(frozen=True)
class ServerSettings:
    # a client that stops reading is cut off after this, without slowing anyone else
    write_deadline: str = "10s"
    # half-open connections (a vanished client) and stalled services are cut off within
    # ping_interval * (ping_max + 1); a stalled scheduler's requests are ended elsewhere only
    # once nats-server dropped its connection (docs/services.md, "Fencing")
    ping_interval: str = "5s"
    ping_max: int = 2
    max_payload: str = "1MB"
    extra: tuple[str, ...] = field(default=())


def _quote(value: str) -> str:
    return value if value.startswith("$") else '"' + value.replace('"', '\\"') + '"'


def _list(items: Sequence[str], indent: str) -> str:
    lines: list[str] = []
    line = ""
    for item in (f'"{s}"' for s in items):
        piece = item if not line else f", {item}"
        if len(indent) + len(line) + len(piece) > 96 and line:
            lines.append(line + ",")
            line = item
        else:
            line += piece
    lines.append(line)
    return ("\n" + indent).join(lines)


def _block(name: str, perms: Permissions) -> str:
    pad = " " * 15  # under the first item of "      allow = ["
    sub = f"allow = [{_list(perms.subscribe, pad)}]"
    if perms.subscribe_deny:
        sub += f"\n      deny = [{_list(perms.subscribe_deny, pad[:-1])}]"
    return (
        f"  {name} = {{\n"
        f"    publish = {{\n      allow = [{_list(perms.publish, pad)}]\n    }}\n"
        f"    subscribe = {{\n      {sub}\n    }}\n"
        f"  }}\n"
    )


def render_config(
    user_list: Sequence[User],
    *,
    settings: ServerSettings | None = None,
    route_user: tuple[str, str] | None = None,
    header: str = "",
) -> str:
    """A nats-server config: limits, the authorization block, and (``route_user``) the
    credentials cluster routes must present."""
    s = settings or ServerSettings()
    out = [header] if header else []
    out.append(
        f'write_deadline: "{s.write_deadline}"\nping_interval: "{s.ping_interval}"\n'
        f"ping_max: {s.ping_max}\nmax_payload: {s.max_payload}\n"
    )
    out.extend(f"{line}\n" for line in s.extra)
    blocks = [_block(u.role, u.permissions) for u in user_list if u.permissions is not None]
    entries = []
    for u in user_list:
        perms = f", permissions: ${u.role}" if u.permissions is not None else ""
        entries.append(f"    {{ user: {u.name}, password: {_quote(u.password)}{perms} }}")
    users_block = "\n  users = [\n" + "\n".join(entries) + "\n  ]\n"
    out.append("\nauthorization {\n" + "".join(blocks) + users_block + "}\n")
    if route_user is not None:
        user, password = route_user
        out.append(
            "\n# routes between the cluster's nodes present these credentials\n"
            f"cluster {{\n  authorization {{ user: {user}, password: {_quote(password)} }}\n}}\n"
        )
    return "".join(out)


DEPLOY_HEADER = """\
# NATS for rlt, GENERATED from services/runtime/permissions.py (the one permission model;
# `rlt up` renders the same one with random passwords per run). Regenerate with
#   python -m services.runtime.permissions > deploy/nats.conf
# (`--tenant NAME`, repeatable, adds a tenant user). Passwords come from the environment
# (nats-server resolves $NAME): under compose, deploy/nats-entrypoint.sh exports them from
# the files compose's init step wrote; by hand, `scripts/nats_secrets.sh` writes them to .env.
# JetStream and ports are set on the command line; compose's cluster block (listen address
# and authenticated routes) is in deploy/nats-cluster.conf, which includes this file.
#
# Roles (docs/services.md, "Security model"):
#   admission     takes rlt.v1.generate / rlt.v1.abort (and rlt.v1.tenant.<t>.*), routes
#                 each request to a shard (rlt.v1.sched.submit.<shard>), relays its stream
#                 to the client's inbox
#   scheduler     (one per shard) batches to its worker, stream events to admission's relay
#                 subject, prefix events (JetStream), shard announcements
#   worker        (one per shard) results and heartbeats
#   prefix-cache  reads the event stream, keeps snapshots in the object store
#   client        the default tenant: rlt.v1.generate / rlt.v1.abort, reads _INBOX.> except
#                 tenants' inboxes
#   tenant-<t>    rlt.v1.tenant.<t>.generate / .abort, reads _INBOX.tenant.<t>.> only
#   operator      everything (nats micro ls, health requests, debugging)
"""


@dataclass(frozen=True)
class LocalAuth:
    """Random credentials for one ``rlt up``: every user of the model, and the routes."""

    passwords: dict[str, str]
    tenants: tuple[str, ...] = ()

    @classmethod
    def generate(cls, tenants: Sequence[str] = ()) -> LocalAuth:
        names = [*all_user_names(tenants), "route"]
        return cls(random_passwords(names), tuple(tenants))

    def config(self, settings: ServerSettings | None = None, cluster: bool = False) -> str:
        return render_config(
            users(self.passwords, self.tenants),
            settings=settings,
            route_user=self.route if cluster else None,
            header="# generated by `rlt up` for this run: random passwords, removed on exit\n",
        )

    def url(self, user: str, servers: str) -> str:
        """``servers`` (a comma-separated list) with ``user``'s credentials in each."""
        return with_credentials(servers, user, self.passwords[user])

    @property
    def route(self) -> tuple[str, str]:
        return "route", self.passwords["route"]


def deploy_config(tenants: Sequence[str] = ()) -> str:
    """deploy/nats.conf: every password from the environment."""
    names = all_user_names(tenants)
    passwords = {name: f"${password_var(name)}" for name in names}
    return render_config(
        users(passwords, tenants),
        route_user=("route", f"${password_var('route')}"),
        header=DEPLOY_HEADER + "\n",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="print deploy/nats.conf")
    parser.add_argument("--tenant", action="append", default=[], help="add a tenant user")
    args = parser.parse_args(argv)
    tenants = [subjects.check_tenant(t) for t in args.tenant]
    sys.stdout.write(deploy_config(tenants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
