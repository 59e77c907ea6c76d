"""spotdrain-coordinator: the gRPC server, its store and one supervisor."""

from __future__ import annotations

import asyncio
import logging
import sys
import tomllib

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from spotdrain.coordinator.api.admin import AdminServicer
from spotdrain.coordinator.api.agent_link import AgentLinkServicer, Coordinator
from spotdrain.coordinator.api.health import HealthServicer
from spotdrain.coordinator.api.public import RentalsServicer, RoutesServicer
from spotdrain.coordinator.api.rejections import RejectionGuard
from spotdrain.coordinator.capacity.acquirer import acquirers_from_config, avoid_s_from_config
from spotdrain.coordinator.capacity.contracts import DEFAULT_BUDGET, DEFAULT_MIN, ContractPolicy
from spotdrain.coordinator.dashboard import Dashboard, DashboardConfig
from spotdrain.coordinator.dashboard.app import is_loopback
from spotdrain.coordinator.dashboard.auth import TokenError, load_token
from spotdrain.coordinator.gc_pauses import Pauses
from spotdrain.coordinator.replicas import leadership as replicas
from spotdrain.coordinator.store import StoreError, open_store
from spotdrain.net.security import server_credentials, warn_insecure
from spotdrain.protocol import limits, timing
from spotdrain.runtime import systemd
from spotdrain.runtime.cli import ArgumentParser, UsageError, add_bounded, fail_usage, host_port
from spotdrain.runtime.metrics import serve as metrics_serve
from spotdrain.runtime.supervisor import Supervisor
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

PROG = "spotdrain-coordinator"
log = logging.getLogger("spotdrain.coordinator")


def parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="spotdrain coordinator (gRPC)")
    p.add_argument("--listen", required=True, help="HOST:PORT (port 0 picks a free one)")
    p.add_argument(
        "--db",
        required=True,
        help="the store: a SQLite file (or sqlite:///PATH), or a PostgreSQL libpq URI "
        "(postgresql://..., multi-host with target_session_attrs=read-write)",
    )
    p.add_argument("--insecure", action="store_true", help="plaintext, no client identities")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--client-ca", help="CA that signs node and operator certificates")
    add_bounded(
        p,
        "--start-timeout-s",
        0.1,
        86400,
        timing.START_TIMEOUT_S,
        "a worker not started this long after it was placed is given up",
    )
    p.add_argument(
        "--metrics-listen", default="", help="serve Prometheus /metrics on HOST:PORT (default: off)"
    )
    add_bounded(
        p,
        "--heartbeat-ttl-s",
        0.1,
        3600,
        timing.HEARTBEAT_TTL_S,
        "a ready worker without a heartbeat this long is missing",
    )
    add_bounded(
        p,
        "--node-gone-s",
        0.1,
        30 * 86400,
        timing.NODE_GONE_S,
        "a node under a reclamation: its rentals end this long after it disconnected",
    )
    add_bounded(
        p,
        "--node-lost-s",
        0.1,
        30 * 86400,
        timing.NODE_LOST_S,
        "a disconnected node with work and no reclamation open is lost after this long",
    )
    p.add_argument(
        "--acquirers",
        default="",
        help="TOML file: replacement acquirers per node group and the avoidance window "
        "(default: none; see README)",
    )
    add_bounded(
        p,
        "--contract-budget",
        0,
        1,
        DEFAULT_BUDGET,
        "share of an image's reclamations that may end killed at G or overrun before it is flagged",
    )
    p.add_argument(
        "--contract-min",
        type=int,
        default=DEFAULT_MIN,
        help=f"reclamations an image needs before it is judged (default {DEFAULT_MIN})",
    )
    p.add_argument(
        "--no-spot-for-flagged",
        action="store_true",
        help="keep images whose workload contract is flagged off spot nodes (the placement gate)",
    )
    p.add_argument(
        "--dashboard-listen",
        default="",
        help="serve the web dashboard on HOST:PORT (default: off; loopback only unless "
        "--dashboard-public)",
    )
    p.add_argument(
        "--dashboard-token-file",
        default="",
        help="file holding the operator token the dashboard's actions need (default: none, "
        "the dashboard is read-only)",
    )
    p.add_argument(
        "--dashboard-public",
        action="store_true",
        help="let --dashboard-listen bind a non-loopback address (see docs/operations.md)",
    )
    replicas.add_arguments(p)
    p.add_argument("--log-level", default="INFO")
    return p


MAX_FLEET = 10_000  # nodes one coordinator is sized for (the fleet benchmark's largest size)
SERVER_OPTIONS = [
    # Set on purpose (spotdrain.protocol.limits): an agent's message is at most this big, an
    # operator's reply (ListNodes of a large fleet) may be bigger.
    ("grpc.max_receive_message_length", limits.MAX_AGENT_MESSAGE_BYTES),
    ("grpc.max_send_message_length", limits.MAX_ADMIN_MESSAGE_BYTES),
    # Agents ping every 10 s to notice a dead coordinator; the default policy (5 minutes
    # between pings) would answer them with GOAWAY, ending every node's stream.
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
    # Streams the server has accepted but the application has not picked up yet. gRPC's
    # defaults (1,000, hard limit 3,000) end the rest of a reconnect storm before `Registered`
    # (thousands of streams at 10,000 nodes); a fleet that comes back at once must all get in.
    ("grpc.server.max_pending_requests", 4 * MAX_FLEET),
    ("grpc.server.max_pending_requests_hard_limit", 8 * MAX_FLEET),
]


async def serve(args) -> int:  # noqa: ANN001 (argparse namespace)
    host, port = host_port(args.listen, "--listen")
    tls = (args.tls_cert, args.tls_key, args.client_ca)
    if args.insecure and any(tls):
        raise UsageError("--insecure and TLS flags exclude each other")
    if not args.insecure and not all(tls):
        raise UsageError("give --tls-cert, --tls-key and --client-ca, or --insecure")
    try:
        contract_policy = ContractPolicy(
            args.contract_budget, args.contract_min, args.no_spot_for_flagged
        )
    except ValueError as e:
        raise UsageError(f"--contract-budget/--contract-min: {e}") from e
    dashboard = dashboard_config(args)
    replicas.check_arguments(args)
    creds = None if args.insecure else server_credentials(*tls)  # type: ignore[arg-type]
    acquirers, avoid_s = load_acquirers(args.acquirers)
    try:
        store = await open_store(args.db)
    except StoreError as e:
        raise UsageError(str(e)) from e
    try:
        return await _serve(
            args, host, port, creds, store, acquirers, avoid_s, contract_policy, dashboard
        )
    finally:
        await store.close()


async def _serve(args, host, port, creds, store, acquirers, avoid_s, contracts, dashboard) -> int:  # noqa: ANN001, E501
    if args.insecure:
        warn_insecure(PROG)
    coord = Coordinator(
        store,
        insecure=args.insecure,
        heartbeat_ttl_s=args.heartbeat_ttl_s,
        start_timeout_s=args.start_timeout_s,
        node_gone_s=args.node_gone_s,
        node_lost_s=args.node_lost_s,
        acquirers=acquirers,
        avoid_s=avoid_s,
        contract_policy=contracts,
    )
    pauses = Pauses(coord.registry)
    pauses.install()
    # In front of every service: undecodable bodies answered INVALID_ARGUMENT, never UNKNOWN;
    # each rejection counted, and logged at most once per peer a minute
    # (coordinator/api/rejections.py).
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[RejectionGuard(coord.registry)])
    # Several replicas (--advertise): the lease decides which one serves; the others send
    # callers to it (coordinator/replicas/leadership.py). Without it, one coordinator as before.
    replica = None
    if args.advertise:
        replica = replicas.Replica(store, args.advertise, args.lease_ttl_s, args.lease_renew_s)

    def guard(servicer, service: str):  # noqa: ANN001, ANN202 (a servicer)
        return servicer if replica is None else replica.guard(servicer, service)

    pb_grpc.add_AgentLinkServicer_to_server(guard(AgentLinkServicer(coord), "AgentLink"), server)
    pb_grpc.add_AdminServicer_to_server(guard(AdminServicer(coord), "Admin"), server)
    pb_grpc.add_RoutesServicer_to_server(guard(RoutesServicer(coord), "Routes"), server)
    pb_grpc.add_RentalsServicer_to_server(guard(RentalsServicer(coord), "Rentals"), server)
    health_servicer = HealthServicer()  # the reference one, with List
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = [
        pb.DESCRIPTOR.services_by_name[name].full_name
        for name in ("AgentLink", "Admin", "Routes", "Rentals")
    ]
    reflection.enable_server_reflection(
        [*services, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    address = f"{host}:{port}"
    try:
        bound = (
            server.add_insecure_port(address)
            if creds is None
            else server.add_secure_port(address, creds)
        )
    except RuntimeError:  # grpc's "Failed to bind": a port in use, an address not ours
        bound = 0
    if bound == 0:
        raise UsageError(f"cannot listen on {address} (in use, or not an address of this host)")
    # Startup and the recovery loop share one path: rebuild from the store (before serving, so
    # no agent or router sees an empty registry), then recover. A replica does so when it
    # takes the lease.
    if replica is None:
        await coord.fleet.recovery.rebuild()
        pauses.freeze()  # what rebuild loaded lives as long as the process
    await server.start()
    if args.metrics_listen:
        host_port(args.metrics_listen, "--metrics-listen")
        metrics_port = metrics_serve(coord.registry, args.metrics_listen)
        print(
            f"{PROG}: metrics on {args.metrics_listen.rpartition(':')[0]}:{metrics_port}",
            flush=True,
        )
    web = None
    if dashboard is not None:
        web = Dashboard(coord, dashboard)
        try:
            web_port = await web.start()
        except OSError as e:
            raise UsageError(f"--dashboard-listen {args.dashboard_listen}: {e.strerror}") from e
        print(f"{PROG}: dashboard on http://{_url_host(dashboard.host)}:{web_port}/", flush=True)
    for name in ["", *services] if replica is None else [""]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if replica is not None:
        await replica.report_health(health_servicer, services)
    # Tests and the demo read the bound port from this line.
    print(f"{PROG}: listening on {host}:{bound}", flush=True)
    log.info(
        "listening on %s:%d, store %s (%s), %s",
        host,
        bound,
        store.where,
        store.backend.name,
        "PLAINTEXT" if creds is None else "mutual TLS",
    )

    # systemd (Type=notify): the store is open and the server serving, so READY; then STATUS=
    # on changes, and the watchdog ping while the recovery loop still runs.
    def describe() -> str:
        return _describe(coord, f"{host}:{bound}")

    systemd.ready(said := describe())
    supervisor = Supervisor()
    supervisor.install_signal_handlers()
    recovery_done = asyncio.Event()

    async def recovery() -> None:
        try:
            if replica is not None:
                await replica.ready.wait()  # the leader's, once it has rebuilt
            await coord.fleet.recovery.loop()
        finally:
            recovery_done.set()

    try:
        if replica is not None:  # its end (a step-down) ends the process: a clean follower next
            supervisor.add(
                "lease", replica.run(replicas.taking_over(coord, pauses)), essential=True
            )
        supervisor.add("recovery", recovery(), essential=True)
        supervisor.add("gc-freeze", pauses.keep_frozen(), essential=True)
        supervisor.add("gc-young", pauses.keep_young_small(), essential=True)
        supervisor.add("loop-lag", pauses.probe_loop(), essential=True)
        supervisor.add("systemd-status", systemd.keep_status(describe, last=said))
        # Pinged only while the recovery loop runs.
        supervisor.add("watchdog", systemd.keep_watchdog(lambda: not recovery_done.is_set()))
        rc = await supervisor.run()
    finally:
        await supervisor.shutdown()
        systemd.stopping()
        log.info("stopping")
        await health_servicer.enter_graceful_shutdown()
        if web is not None:
            await web.close()
        await server.stop(grace=2.0)
        await coord.fleet.close()
        pauses.uninstall()
    return rc


def dashboard_config(args) -> DashboardConfig | None:  # noqa: ANN001
    """The --dashboard-* flags, checked before anything starts."""
    if not args.dashboard_listen:
        if args.dashboard_token_file or args.dashboard_public:
            raise UsageError(
                "--dashboard-token-file and --dashboard-public need --dashboard-listen"
            )
        return None
    host, port = host_port(args.dashboard_listen, "--dashboard-listen")
    if not is_loopback(host) and not args.dashboard_public:
        # The fleet is readable without a credential: off loopback only when asked for.
        raise UsageError(
            f"--dashboard-listen {args.dashboard_listen} is not a loopback address; the "
            "dashboard shows the fleet to anyone who reaches it: add --dashboard-public to mean it"
        )
    try:
        token = load_token(args.dashboard_token_file) if args.dashboard_token_file else None
    except TokenError as e:
        raise UsageError(str(e)) from e
    return DashboardConfig(host, port, token, public=args.dashboard_public)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


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
        f"serving on {address}; {len(coord.fleet.nodes.streams)} nodes connected; "
        f"{workers} workers" + (f" ({by_state})" if by_state else "")
    )


# The store's threads hand each statement back to the event loop: with CPython's default 5 ms
# switch interval, a loop busy with a thousand Taints keeps the writer thread waiting for the
# GIL up to 5 ms a statement. 0.5 ms keeps the hand-over short.
SWITCH_INTERVAL_S = 0.0005


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    systemd.configure_logging(PROG, args.log_level)
    try:
        return asyncio.run(serve(args))
    except (UsageError, ValueError) as e:
        return fail_usage(PROG, str(e))


def entry() -> None:
    sys.exit(main())
