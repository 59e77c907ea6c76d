"""spotdrain-coordinator: the gRPC server, its store and one supervisor."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import tomllib

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from spotdrain import systemd
from spotdrain.cli import ArgumentParser, UsageError, fail_usage, host_port
from spotdrain.coordinator.acquirer import acquirers_from_config, avoid_s_from_config
from spotdrain.coordinator.service import (
    AdminServicer,
    AgentLinkServicer,
    Coordinator,
    RentalsServicer,
    RoutesServicer,
)
from spotdrain.coordinator.store import Store, StoreError
from spotdrain.metrics import serve as metrics_serve
from spotdrain.security import server_credentials, warn_insecure
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

PROG = "spotdrain-coordinator"
log = logging.getLogger("spotdrain.coordinator")


def parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="spotdrain coordinator (gRPC)")
    p.add_argument("--listen", required=True, help="HOST:PORT (port 0 picks a free one)")
    p.add_argument("--db", required=True, help="SQLite file")
    p.add_argument("--insecure", action="store_true", help="plaintext, no client identities")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--client-ca", help="CA that signs node and operator certificates")
    p.add_argument(
        "--start-timeout-s",
        type=float,
        default=300.0,
        help="a worker not started this long after it was placed is given up (default 300)",
    )
    p.add_argument(
        "--metrics-listen", default="", help="serve Prometheus /metrics on HOST:PORT (default: off)"
    )
    p.add_argument(
        "--heartbeat-ttl-s",
        type=float,
        default=15.0,
        help="a ready worker without a heartbeat this long is missing (default 15)",
    )
    p.add_argument(
        "--node-gone-s",
        type=float,
        default=600.0,
        help="rentals on a node gone (disconnected) this long end as platform (default 600)",
    )
    p.add_argument(
        "--acquirers",
        default="",
        help="TOML file: replacement acquirers per node group and the avoidance window "
        "(default: none; see README)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


async def serve(args) -> int:  # noqa: ANN001 (argparse namespace)
    host, port = host_port(args.listen, "--listen")
    tls = (args.tls_cert, args.tls_key, args.client_ca)
    if args.insecure and any(tls):
        raise UsageError("--insecure and TLS flags exclude each other")
    if not args.insecure and not all(tls):
        raise UsageError("give --tls-cert, --tls-key and --client-ca, or --insecure")
    creds = None if args.insecure else server_credentials(*tls)  # type: ignore[arg-type]
    acquirers, avoid_s = load_acquirers(args.acquirers)
    try:
        store = Store(args.db)
    except StoreError as e:
        raise UsageError(str(e)) from e

    if args.insecure:
        warn_insecure(PROG)
    if args.heartbeat_ttl_s <= 0:
        raise UsageError("--heartbeat-ttl-s must be positive")
    if args.start_timeout_s <= 0:
        raise UsageError("--start-timeout-s must be positive")
    if args.node_gone_s <= 0:
        raise UsageError("--node-gone-s must be positive")
    coord = Coordinator(
        store,
        insecure=args.insecure,
        heartbeat_ttl_s=args.heartbeat_ttl_s,
        start_timeout_s=args.start_timeout_s,
        node_gone_s=args.node_gone_s,
        acquirers=acquirers,
        avoid_s=avoid_s,
    )
    server = grpc.aio.server()
    pb_grpc.add_AgentLinkServicer_to_server(AgentLinkServicer(coord), server)
    pb_grpc.add_AdminServicer_to_server(AdminServicer(coord), server)
    pb_grpc.add_RoutesServicer_to_server(RoutesServicer(coord), server)
    pb_grpc.add_RentalsServicer_to_server(RentalsServicer(coord), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = [
        pb.DESCRIPTOR.services_by_name[name].full_name
        for name in ("AgentLink", "Admin", "Routes", "Rentals")
    ]
    reflection.enable_server_reflection(
        [*services, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    address = f"{host}:{port}"
    bound = (
        server.add_insecure_port(address)
        if creds is None
        else server.add_secure_port(address, creds)
    )
    if bound == 0:
        raise UsageError(f"cannot listen on {address}")
    # Startup and the recovery loop share one path: rebuild from the store (before serving, so
    # no agent or router sees an empty registry), then recover.
    coord.fleet.rebuild()
    await server.start()
    if args.metrics_listen:
        host_port(args.metrics_listen, "--metrics-listen")
        metrics_port = metrics_serve(coord.registry, args.metrics_listen)
        print(
            f"{PROG}: metrics on {args.metrics_listen.rpartition(':')[0]}:{metrics_port}",
            flush=True,
        )
    for name in ["", *services]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    # Tests and the demo read the bound port from this line.
    print(f"{PROG}: listening on {host}:{bound}", flush=True)
    log.info(
        "listening on %s:%d, store %s, %s",
        host,
        bound,
        args.db,
        "PLAINTEXT" if creds is None else "mutual TLS",
    )

    recovery = asyncio.create_task(coord.fleet.recovery_loop())

    # systemd (Type=notify): the store is open and the server serving, so READY; then STATUS=
    # on changes, and the watchdog ping while the recovery loop still runs.
    def describe() -> str:
        return _describe(coord, f"{host}:{bound}")

    systemd.ready(said := describe())
    notifying = [
        asyncio.create_task(systemd.keep_status(describe, last=said)),
        asyncio.create_task(systemd.keep_watchdog(lambda: not recovery.done())),
    ]

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    systemd.stopping()
    log.info("stopping")
    for task in notifying:
        task.cancel()
    recovery.cancel()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=2.0)
    store.close()
    return 0


def load_acquirers(path: str) -> tuple[dict, float]:
    """The --acquirers file: (acquirer per node group, avoidance window seconds)."""
    if not path:
        return {}, avoid_s_from_config({})
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        return acquirers_from_config(doc), avoid_s_from_config(doc)
    except OSError as e:
        raise UsageError(f"--acquirers {path}: {e.strerror}") from e
    except (tomllib.TOMLDecodeError, ValueError) as e:
        raise UsageError(f"--acquirers {path}: {e}") from e


def _describe(coord: Coordinator, address: str) -> str:
    """One STATUS= line: connected nodes and live workers by state."""
    states: dict[str, int] = {}
    for worker in coord.fleet.live_workers():
        states[worker.state] = states.get(worker.state, 0) + 1
    by_state = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    workers = sum(states.values())
    return (
        f"serving on {address}; {len(coord.fleet.streams)} nodes connected; "
        f"{workers} workers" + (f" ({by_state})" if by_state else "")
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    systemd.configure_logging(PROG, args.log_level)
    try:
        return asyncio.run(serve(args))
    except (UsageError, ValueError) as e:
        return fail_usage(PROG, str(e))


def entry() -> None:
    sys.exit(main())
