"""spotdrain-router: the reference router, an OpenAI-compatible HTTP front over slot gates.

The platform brings its own router (docs/design.md "Components"); this one is for the demo
and the tests, and shows how a router consumes the coordinator's routing API. This module is
the program: flags, identity, the start-up probe, serving until SIGTERM. The routing lives in
`model_routes.py` (each model's table and its watch on the coordinator, or on the leader of
several replicas: `--coordinator a:7443,b:7443`) and `front.py` (the HTTP endpoints, retries
on another worker, the stream relay).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import grpc
from aiohttp import web

from spotdrain.coordinator.router.front import Router
from spotdrain.coordinator.router.model_routes import REFUSED_CODES
from spotdrain.net.leader import Replicas, addresses
from spotdrain.net.security import channel_credentials, warn_insecure
from spotdrain.protocol.limits import MAX_ADMIN_MESSAGE_BYTES
from spotdrain.runtime.cli import ArgumentParser, UsageError, fail_usage, host_port
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

PROG = "spotdrain-router"
log = logging.getLogger("spotdrain.router")

PROBE_TIMEOUT_S = 3.0


# --- the process ------------------------------------------------------------------------------


def parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="spotdrain reference router (OpenAI-compatible)")
    p.add_argument("--listen", required=True, help="HOST:PORT for HTTP (port 0 picks one)")
    p.add_argument(
        "--coordinator", required=True, help="the coordinator's HOST:PORT, or replicas' A:P,B:P"
    )
    p.add_argument("--insecure", action="store_true", help="plaintext gRPC, no identity")
    p.add_argument("--tls-cert", help="this router's certificate (CN router:<name>)")
    p.add_argument("--tls-key")
    p.add_argument("--ca", help="CA that signed the coordinator's certificate")
    p.add_argument("--attempts", type=int, default=3, help="workers to try per request (default 3)")
    p.add_argument(
        "--continue-cut-streams",
        type=_on_off,
        default=True,
        metavar="true|false",
        help="continue a stream its worker's reclamation cut on another worker (default true)",
    )
    p.add_argument(
        "--max-continuations",
        type=int,
        default=2,
        help="continuations per request before it is reported interrupted (default 2)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _on_off(value: str) -> bool:
    if value.lower() in ("true", "on", "yes", "1"):
        return True
    if value.lower() in ("false", "off", "no", "0"):
        return False
    raise ValueError(value)


async def _refused_by_coordinator(replicas: Replicas, coordinator: str) -> str:
    """Ask once whether this identity may read routes. A refusal is permanent, so it is said at
    start; an unreachable coordinator, or one with no leader yet, is not (the watches keep
    trying)."""
    try:
        await replicas.on_leader(
            pb_grpc.RoutesStub, "PickWorker", pb.PickWorkerRequest(model=""), PROBE_TIMEOUT_S
        )
    except grpc.aio.AioRpcError as e:
        if e.code() in REFUSED_CODES:
            return (
                f"the coordinator at {coordinator} refused this router: "
                f"{e.code().name}: {e.details()}"
            )
        # Otherwise the coordinator let us in (no worker for model "") or is not reachable
        # yet: either way the watches take it from here.
        log.info("coordinator %s: probe answered %s: %s", coordinator, e.code().name, e.details())
    return ""


# A model's first WatchRoutes snapshot lists every routable worker of it: at a large fleet
# that can outgrow gRPC's 4 MiB default receive limit and fail the watch (RESOURCE_EXHAUSTED).
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_ADMIN_MESSAGE_BYTES),
    # Notice a leader that vanished (host gone, SIGSTOP) and move on, as the agent does.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


async def serve(args) -> int:  # noqa: ANN001 (argparse namespace)
    listen_host, listen_port = host_port(args.listen, "--listen")
    coordinators = addresses(args.coordinator, "--coordinator")
    if args.attempts < 1:
        raise UsageError(f"--attempts must be at least 1, got {args.attempts}")
    if not 0 <= args.max_continuations <= 16:
        raise UsageError(f"--max-continuations must be 0 to 16, got {args.max_continuations}")
    tls = (args.tls_cert, args.tls_key, args.ca)
    if args.insecure and any(tls):
        raise UsageError("--insecure and TLS flags exclude each other")
    if not args.insecure and not all(tls):
        raise UsageError("give --tls-cert, --tls-key and --ca, or --insecure")
    if args.insecure:
        warn_insecure(PROG)
        replicas = Replicas(
            coordinators, lambda a: grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS)
        )
    else:
        try:
            creds = channel_credentials(*tls)
        except ValueError as e:  # an unreadable certificate or key: a config error
            raise UsageError(str(e)) from e
        replicas = Replicas(
            coordinators, lambda a: grpc.aio.secure_channel(a, creds, options=CHANNEL_OPTIONS)
        )
    try:
        refused = await _refused_by_coordinator(replicas, args.coordinator)
        if refused:
            print(f"{PROG}: error: {refused}", file=sys.stderr, flush=True)
            return 1
        router = Router(
            replicas,
            args.attempts,
            continue_cut=args.continue_cut_streams,
            max_continuations=args.max_continuations,
        )
        await router.start()
        runner = web.AppRunner(
            router.app(),
            handle_signals=False,
            handler_cancellation=True,  # a client that goes away closes its upstream at once
            access_log=None,
            shutdown_timeout=5.0,
        )
        await runner.setup()
        try:
            await web.TCPSite(runner, listen_host, listen_port, backlog=1024).start()
        except OSError as e:
            await runner.cleanup()
            await router.close()
            raise UsageError(f"cannot listen on {args.listen}: {e.strerror}") from e
        port = runner.addresses[0][1]
        # Tests and the demo read the bound port from this line.
        print(f"{PROG}: listening on {listen_host}:{port}", flush=True)
        log.info(
            "routing for coordinator %s (%s), %d attempts per request, cut streams %s",
            args.coordinator,
            "PLAINTEXT" if args.insecure else "mutual TLS",
            args.attempts,
            f"continued up to {router.max_continuations} times"
            if router.max_continuations
            else "reported interrupted",
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping")
        await runner.cleanup()
        await router.close()
        return 0
    finally:
        await replicas.close()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        return asyncio.run(serve(args))
    except UsageError as e:
        return fail_usage(PROG, str(e))


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
