"""Container health check: ``python -m services.runtime.health NAME [--nats-url URL]``.

Honest per-instance check: reads the identity file the service in *this* container wrote
when it became ready, checks that its process is alive, and pings that exact NATS micro
instance (``$SRV.PING.<name>.<id>``), so a healthy replica elsewhere cannot answer for it.
Exit 0 healthy, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import nats

from services.runtime import subjects
from services.runtime.bus import auth_options, server_list
from services.runtime.service import health_file


async def check(name: str, nats_url: str, timeout: float) -> str | None:
    """None when healthy, else the reason."""
    path = health_file(name)
    try:
        ident = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"no identity file {path}: {exc}"
    try:
        os.kill(int(ident["pid"]), 0)
    except (OSError, KeyError, ValueError):
        return f"process {ident.get('pid')} is not running"
    try:
        # the service's own credentials and inbox prefix (what its NATS user may subscribe)
        nc = await nats.connect(
            server_list(nats_url),
            connect_timeout=timeout,
            allow_reconnect=False,
            inbox_prefix=subjects.service_inbox(subjects.micro_name(name)),
            **auth_options(),
        )
    except Exception as exc:
        return f"cannot reach NATS at {nats_url}: {exc!r}"
    try:
        await nc.request(f"$SRV.PING.{ident['name']}.{ident['id']}", b"", timeout=timeout)
    except Exception as exc:
        return f"{ident['name']} instance {ident['id']} did not answer a ping: {exc!r}"
    finally:
        await nc.close()
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("name", help="admission | scheduler | worker | prefix-cache")
    p.add_argument("--nats-url", default=os.environ.get("RLT_NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--timeout", type=float, default=2.0)
    args = p.parse_args(argv)
    reason = asyncio.run(check(args.name, args.nats_url, args.timeout))
    if reason:
        print(f"unhealthy: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
