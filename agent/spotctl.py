"""spotctl: operators' view of the coordinator (events, timelines).

spotctl --coordinator HOST:PORT [--insecure | --tls-cert F --tls-key F --ca F] events --json
spotctl --coordinator HOST:PORT [...] timeline [RECLAIM_ID] [--json]
"""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from spotdrain.agent import control_socket
from spotdrain.cli import ArgumentParser, UsageError, fail_usage, host_port
from spotdrain.events import stored_event_to_dict
from spotdrain.security import channel_credentials
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

PROG = "spotctl"


def parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="spotdrain operator CLI")
    p.add_argument("--coordinator", help="coordinator HOST:PORT")
    p.add_argument("--insecure", action="store_true", help="plaintext gRPC")
    p.add_argument("--tls-cert", help="operator certificate (CN operator:<name>)")
    p.add_argument("--tls-key")
    p.add_argument("--ca", help="CA of the coordinator's certificate")
    p.add_argument(
        "--socket",
        type=Path,
        default=Path("/run/spotdrain/agent.sock"),
        help="the agent's unix socket (pause, resume, status)",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    for name, text in (
        ("pause", "take the machine back: drain it, free by the deadline"),
        ("resume", "make the machine available again"),
        ("status", "this node's state, workers and drain in progress"),
    ):
        local = sub.add_parser(name, help=text)
        local.add_argument("--json", action="store_true")
    wk = sub.add_parser("workers", help="inference workers")
    wsub = wk.add_subparsers(dest="workers_command", required=True, parser_class=ArgumentParser)
    ws = wsub.add_parser("start", help="place a worker on a node, through the placement gate")
    ws.add_argument("node")
    ws.add_argument("--model", required=True)
    ws.add_argument("--image", required=True)
    ws.add_argument("--slots", type=int, default=4)
    ws.add_argument("--port", type=int, default=0, help="worker port (default: picked)")
    ws.add_argument("--json", action="store_true")
    wl = wsub.add_parser("list", help="workers and their state")
    wl.add_argument("--node", default="")
    wl.add_argument("--json", action="store_true")
    ev = sub.add_parser("events", help="lifecycle events, one JSON object a line")
    ev.add_argument("--json", action="store_true", help="JSON lines (the only format)")
    ev.add_argument("--from", dest="from_id", type=int, default=0, help="after this event id")
    ev.add_argument("--follow", action="store_true", help="keep printing new events")
    tl = sub.add_parser("timeline", help="a reclamation as a table of steps")
    tl.add_argument("reclaim_id", nargs="?", default="", help="default: the latest")
    tl.add_argument("--json", action="store_true")
    return p


def channel(args: Any) -> grpc.aio.Channel:
    if not args.coordinator:
        raise UsageError("--coordinator HOST:PORT is required")
    host_port(args.coordinator, "--coordinator")
    tls = (args.tls_cert, args.tls_key, args.ca)
    if args.insecure:
        if any(tls):
            raise UsageError("--insecure and TLS flags exclude each other")
        return grpc.aio.insecure_channel(args.coordinator)
    if not all(tls):
        raise UsageError("give --tls-cert, --tls-key and --ca, or --insecure")
    return grpc.aio.secure_channel(args.coordinator, channel_credentials(*tls))


async def events(stub: pb_grpc.AdminStub, args: Any) -> int:
    async for stored in stub.WatchEvents(
        pb.WatchEventsRequest(from_id=args.from_id, follow=args.follow)
    ):
        print(json.dumps(stored_event_to_dict(stored), sort_keys=True), flush=True)
    return 0


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _offset(t: float, t0: float) -> str:
    return f"T{t - t0:+.3f}s"


def render_timeline(tl: pb.Timeline) -> str:
    rec = tl.reclamation
    t0 = rec.t0
    lines = [
        f"reclamation {rec.reclaim_id}  node {rec.node_id}  reason {rec.reason}  "
        f"notice {rec.notice_id} ({rec.source})",
        f"T0 {_iso(t0)}   G {_offset(rec.grace_deadline, t0)}   "
        f"O {_offset(rec.overrun_at, t0)}   D {_offset(rec.terminate_at, t0)}",
        "",
        f"{'T+':>10}  {'step':<22} detail",
    ]
    for stored in tl.events:
        d = stored_event_to_dict(stored)
        detail = {k: v for k, v in d.items() if k not in _COMMON}
        text = "  ".join(f"{k}={_short(v)}" for k, v in sorted(detail.items()))
        lines.append(f"{_offset(stored.event.wall_time, t0):>10}  {d['kind']:<22} {text}")
    lines.append("")
    if rec.outcome == "drained":
        lines.append(f"outcome: drained, verified empty with {rec.spare_s:.3f} s to spare before D")
    elif rec.outcome == "overrun":
        lines.append("outcome: OVERRUN: work was still there at O")
    elif rec.outcome:
        lines.append(f"outcome: {rec.outcome}")
    else:
        lines.append("outcome: in progress")
    return "\n".join(lines)


_COMMON = {"id", "kind", "node", "reclaim_id", "wall_time", "t_offset_s", "uid"}


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    if isinstance(value, float):
        text = f"{value:.3f}"
    if len(text) > 24 and isinstance(value, str) and len(value) == 64:
        text = value[:12]  # container ids
    return text


async def timeline(stub: pb_grpc.AdminStub, args: Any) -> int:
    try:
        tl = await stub.GetTimeline(pb.GetTimelineRequest(reclaim_id=args.reclaim_id))
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            print(f"{PROG}: {e.details()}", file=sys.stderr)
            return 1
        raise
    if args.json:
        rec = tl.reclamation
        doc = {
            "reclaim_id": rec.reclaim_id,
            "node": rec.node_id,
            "notice_id": rec.notice_id,
            "reason": rec.reason,
            "source": rec.source,
            "t0": rec.t0,
            "terminate_at": rec.terminate_at,
            "grace_deadline": rec.grace_deadline,
            "overrun_at": rec.overrun_at,
            "outcome": rec.outcome,
            "spare_s": rec.spare_s if rec.HasField("spare_s") else None,
            "steps": dict(rec.steps),
            "events": [stored_event_to_dict(e) for e in tl.events],
        }
        print(json.dumps(doc, sort_keys=True))
    else:
        print(render_timeline(tl))
    return 0


def _worker_doc(w: pb.WorkerInfo) -> dict[str, Any]:
    return {
        "worker_id": w.worker_id,
        "node": w.node_id,
        "model": w.model,
        "image": w.image,
        "port": w.port,
        "capacity": w.capacity,
        "state": w.state,
        "gate_address": w.gate_address,
        "slots_in_use": w.slots_in_use,
        "drain_reason": w.drain_reason or None,
        "grace_deadline": w.grace_deadline if w.HasField("grace_deadline") else None,
    }


async def workers(stub: pb_grpc.AdminStub, args: Any) -> int:
    if args.workers_command == "start":
        info = await stub.StartWorker(
            pb.StartWorkerRequest(
                node_id=args.node,
                model=args.model,
                image=args.image,
                slots=args.slots,
                port=args.port,
            )
        )
        doc = _worker_doc(info)
        print(
            json.dumps(doc, sort_keys=True)
            if args.json
            else f"worker {doc['worker_id']} on {doc['node']}: {doc['state']}"
        )
        return 0
    reply = await stub.ListWorkers(pb.ListWorkersRequest(node_id=args.node))
    docs = [_worker_doc(w) for w in reply.workers]
    if args.json:
        print(json.dumps(docs, sort_keys=True))
        return 0
    print(f"{'worker':<24} {'node':<14} {'model':<14} {'state':<9} {'slots':>7}  gate")
    for d in docs:
        print(
            f"{d['worker_id']:<24} {d['node']:<14} {d['model']:<14} {d['state']:<9} "
            f"{d['slots_in_use']:>3}/{d['capacity']:<3}  {d['gate_address']}"
        )
    return 0


async def local(args: Any) -> int:
    try:
        answer = await control_socket.request(args.socket, args.command)
    except PermissionError:
        print(
            f"{PROG}: {args.socket}: permission denied (root or group spotdrain only)",
            file=sys.stderr,
        )
        return 1
    except (OSError, TimeoutError) as e:
        print(f"{PROG}: cannot reach the agent at {args.socket}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, sort_keys=True))
        return 0 if answer.get("ok") else 1
    if not answer.get("ok"):
        print(f"{PROG}: refused: {answer.get('error')}", file=sys.stderr)
        return 1
    print(render_status(answer))
    return 0


def render_status(doc: dict[str, Any]) -> str:
    lines = [
        f"node {doc.get('node')}: {doc.get('state')}"
        f"{' (paused by its owner)' if doc.get('paused') else ''}"
    ]
    drain = doc.get("drain")
    if drain:
        lines.append(
            f"drain {drain['reclaim_id']} ({drain['reason']}): {drain['phase']}, "
            f"grace deadline in {drain['grace_in_s']:.1f} s, "
            f"deadline in {drain['deadline_in_s']:.1f} s"
        )
    for w in doc.get("workers", []):
        lines.append(
            f"  worker {w['worker_id']}: {w['state']}, slots {w['slots_in_use']}/{w['capacity']}"
        )
    return "\n".join(lines)


async def run(args: Any) -> int:
    if args.command in ("pause", "resume", "status"):
        return await local(args)
    async with channel(args) as ch:
        stub = pb_grpc.AdminStub(ch)
        try:
            if args.command == "events":
                return await events(stub, args)
            if args.command == "workers":
                return await workers(stub, args)
            return await timeline(stub, args)
        except grpc.aio.AioRpcError as e:
            print(
                f"{PROG}: coordinator {args.coordinator}: {e.code().name}: {e.details()}",
                file=sys.stderr,
            )
            return 1


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return asyncio.run(run(args))
    except UsageError as e:
        return fail_usage(PROG, str(e))
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    sys.exit(main())
