"""spotctl: the owner's switch on a host, and operators' view of the coordinator.

On the host, through the agent's unix socket:
  spotctl [--socket PATH] pause | resume | status [--json]

Against the coordinator; [...] stands for --coordinator HOST:PORT (or every replica's,
A:PORT,B:PORT) and either --insecure or --tls-cert F --tls-key F --ca F:
  spotctl [...] events --json [--from ID] [--follow]
  spotctl [...] timeline [RECLAIM_ID] [--json] [--svg FILE]
  spotctl [...] workers start NODE --model M --image IMAGE [--slots N] [--port P]
                [--kind inference|batch|render] [--json]
  spotctl [...] workers list [--node NODE] [--json]
  spotctl [...] nodes [--json]
  spotctl [...] node set-spot NODE true|false [--json]
  spotctl [...] rentals [list] [--node NODE] [--active] [--json]
  spotctl [...] rentals create NODE --image IMAGE [--gpus N] [--renter NAME] [--json]
  spotctl [...] rentals get | watch RENTAL_ID [--json]
  spotctl [...] rentals end RENTAL_ID [--ended-by renter|provider|platform] [--json]
  spotctl [...] reputation NODE | --provider PROVIDER [--json]
  spotctl [...] models list [--json]
  spotctl [...] models set-replicas MODEL N [--image IMAGE] [--slots S] [--json]
  spotctl [...] workloads [--json]

--json prints one JSON object a line, with the proto's field names (optional fields absent when
unset); `workers list --json` keeps printing one array, as it always has.

Several replicas: each call goes to the leader (spotdrain.net.leader: a follower's refusal names it,
else the next address), and waits up to --leader-wait-s for one while the leader changes;
`events --follow` and `rentals watch` carry on at another replica from where they were.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from spotdrain.agent.host import control_socket
from spotdrain.agent.spotctl.arguments import PROG, parser
from spotdrain.agent.spotctl.render import (
    render_models,
    render_nodes,
    render_rental,
    render_rentals,
    render_reputation,
    render_status,
    render_timeline,
    shown,
)
from spotdrain.net.leader import Replicas, addresses
from spotdrain.net.security import channel_credentials
from spotdrain.protocol.events import stored_event_to_dict
from spotdrain.protocol.limits import MAX_ADMIN_MESSAGE_BYTES
from spotdrain.runtime.cli import UsageError, fail_usage
from spotdrain.runtime.printable import printable
from spotdrain.timeline import svg as timeline_svg
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

# Calls that must not take effect twice: retried only when no leader can have run them.
ONCE_ONLY = frozenset({"StartWorker", "CreateRental"})


# A coordinator at 10,000 nodes answers ListNodes (and status, events) with several MB: above
# gRPC's 4 MiB default receive limit, which would fail the call with RESOURCE_EXHAUSTED.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_ADMIN_MESSAGE_BYTES)]


def replicas(args: Any) -> Replicas:
    """The coordinator's address, or every replica's."""
    if not args.coordinator:
        raise UsageError("--coordinator HOST:PORT is required")
    found = addresses(args.coordinator, "--coordinator")
    if not (math.isfinite(args.leader_wait_s) and args.leader_wait_s >= 0):
        raise UsageError(f"--leader-wait-s must be a number >= 0, got {args.leader_wait_s}")
    tls = (args.tls_cert, args.tls_key, args.ca)
    if args.insecure:
        if any(tls):
            raise UsageError("--insecure and TLS flags exclude each other")
        return Replicas(found, lambda a: grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS))
    if not all(tls):
        raise UsageError("give --tls-cert, --tls-key and --ca, or --insecure")
    creds = channel_credentials(*tls)
    return Replicas(found, lambda a: grpc.aio.secure_channel(a, creds, options=CHANNEL_OPTIONS))


class LeaderStub:
    """A generated stub's calls, each answered by the leader (spotdrain.net.leader): a unary call
    waits up to `wait_s` for one; a server stream is opened again elsewhere when it breaks."""

    def __init__(self, replicas: Replicas, stub_class: type, service: str, wait_s: float):
        for method in pb.DESCRIPTOR.services_by_name[service].methods:
            name = method.name
            if method.server_streaming:

                def stream(request: Any, name: str = name) -> Any:  # noqa: ANN401
                    return replicas.stream_from_leader(stub_class, name, lambda: request, wait_s)

                setattr(self, name, stream)
            else:

                def unary(request: Any, name: str = name, **kw: Any) -> Any:  # noqa: ANN401
                    return replicas.until_leader(
                        stub_class,
                        name,
                        request,
                        wait_s,
                        kw.get("timeout"),
                        once_only=name in ONCE_ONLY,
                    )

                setattr(self, name, unary)


def message_doc(msg: Message) -> dict[str, Any]:
    """The proto's field names; every plain field, optional ones only when set."""
    return json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def say(text: str) -> None:
    """A message for a person on stderr; what it quotes (a coordinator's details, an error)
    escaped as every other human-readable output."""
    print(printable(text), file=sys.stderr)


def emit(args: Any, messages: Iterable[Message], text: str) -> int:
    """One JSON object a line with --json, else the rendered text (built with `shown`)."""
    if args.json:
        for msg in messages:
            print(json.dumps(message_doc(msg), sort_keys=True), flush=True)
    else:
        print(text, flush=True)
    return 0


async def events(stub: Any, args: Any) -> int:  # noqa: ANN401
    last_id = args.from_id
    # Opened again from the last id printed, on another replica if need be (any replica serves
    # events from the store): each event printed once.
    async for stored in args.coordinators.stream_from_leader(
        pb_grpc.AdminStub,
        "WatchEvents",
        lambda: pb.WatchEventsRequest(from_id=last_id, follow=args.follow),  # noqa: B023 (late: the latest id)
        args.leader_wait_s,
    ):
        if stored.id <= last_id:
            continue
        last_id = stored.id
        print(json.dumps(stored_event_to_dict(stored), sort_keys=True), flush=True)
    return 0


async def timeline(stub: pb_grpc.AdminStub, args: Any) -> int:
    try:
        tl = await stub.GetTimeline(pb.GetTimelineRequest(reclaim_id=args.reclaim_id))
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            say(f"{PROG}: {e.details()}")
            return 1
        raise
    if args.svg:
        # The dashboard's drawing (spotdrain.timeline.svg), of the record GetTimeline answered.
        try:
            await asyncio.to_thread(
                Path(args.svg).write_text, timeline_svg.render(tl), encoding="utf-8"
            )
        except OSError as e:
            say(f"{PROG}: --svg {args.svg}: {e.strerror}")
            return 1
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
        "kind": w.kind,
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
                kind=args.kind,
            )
        )
        doc = _worker_doc(info)
        print(
            json.dumps(doc, sort_keys=True)
            if args.json
            else shown([f"worker {doc['worker_id']} on {doc['node']}: {doc['state']}"])
        )
        return 0
    reply = await stub.ListWorkers(pb.ListWorkersRequest(node_id=args.node))
    docs = [_worker_doc(w) for w in reply.workers]
    if args.json:
        print(json.dumps(docs, sort_keys=True))
        return 0
    lines = [f"{'worker':<24} {'node':<14} {'model':<14} {'state':<9} {'slots':>7}  gate"]
    for d in docs:
        lines.append(
            f"{d['worker_id']:<24} {d['node']:<14} {d['model']:<14} {d['state']:<9} "
            f"{d['slots_in_use']:>3}/{d['capacity']:<3}  {d['gate_address']}"
        )
    print(shown(lines))
    return 0


async def nodes(stub: pb_grpc.AdminStub, args: Any) -> int:
    reply = await stub.ListNodes(pb.ListNodesRequest())
    return emit(args, reply.nodes, render_nodes(reply.nodes, time.time()))


async def node(stub: pb_grpc.AdminStub, args: Any) -> int:
    # The only node sub-command today: set-spot. The coordinator refuses it mid-rental.
    n = await stub.SetNodeSpot(pb.SetNodeSpotRequest(node_id=args.node, spot=args.spot == "true"))
    return emit(args, [n], render_nodes([n], time.time()))


async def rentals(stub: pb_grpc.RentalsStub, args: Any) -> int:
    command = args.rentals_command or "list"
    if command == "list":
        reply = await stub.ListRentals(
            pb.ListRentalsRequest(node_id=args.node, active_only=args.active)
        )
        return emit(args, reply.rentals, render_rentals(reply.rentals, time.time()))
    if command == "watch":
        last = b""
        async for r in stub.WatchRental(pb.GetRentalRequest(rental_id=args.rental_id)):
            # A watch opened again at a new leader starts with the rental as it is: printed
            # only if it changed.
            if (now := r.SerializeToString(deterministic=True)) != last:
                last = now
                emit(args, [r], render_rental(r, time.time()))
        return 0
    if command == "create":
        r = await stub.CreateRental(
            pb.CreateRentalRequest(
                node_id=args.node_id, image=args.image, gpus=args.gpus, renter=args.renter
            )
        )
    elif command == "get":
        r = await stub.GetRental(pb.GetRentalRequest(rental_id=args.rental_id))
    else:
        r = await stub.EndRental(
            pb.EndRentalRequest(rental_id=args.rental_id, ended_by=args.ended_by)
        )
    return emit(args, [r], render_rental(r, time.time()))


async def reputation(stub: pb_grpc.AdminStub, args: Any) -> int:
    request = (
        pb.GetReputationRequest(provider=args.provider)
        if args.provider is not None
        else pb.GetReputationRequest(node_id=args.node)
    )
    rep = await stub.GetReputation(request)
    return emit(args, [rep], render_reputation(rep))


async def models(stub: pb_grpc.AdminStub, args: Any) -> int:
    if args.models_command == "list":
        reply = await stub.ListModels(pb.ListModelsRequest())
        return emit(args, reply.models, render_models(reply.models))
    m = await stub.SetModelReplicas(
        pb.SetModelReplicasRequest(
            model=args.model, replicas=args.replicas, image=args.image, slots=args.slots
        )
    )
    return emit(args, [m], render_models([m]))


async def workloads(stub: pb_grpc.AdminStub, args: Any) -> int:
    reply = await stub.ListWorkloadContracts(pb.ListWorkloadContractsRequest())
    rows = [
        {
            "image": c.image,
            "kind": c.kind,
            "exited": c.exited,
            "killed": c.killed,
            "overrun": c.overrun,
            "reclamations": c.reclamations,
            "share": c.share,
            "flagged": c.flagged,
            "flagged_at": c.flagged_at if c.HasField("flagged_at") else None,
        }
        for c in reply.contracts
    ]
    if args.json:
        print(
            json.dumps(
                {
                    "budget": reply.budget,
                    "min_reclamations": reply.min_reclamations,
                    "no_spot_for_flagged": reply.no_spot_for_flagged,
                    "workloads": rows,
                },
                sort_keys=True,
            )
        )
        return 0
    lines = [
        f"{'image':<40} {'kind':<9} {'reclaimed':>9} {'exited':>7} {'killed':>7} "
        f"{'overrun':>7} {'share':>7}  flagged"
    ]
    for r in rows:
        lines.append(
            f"{r['image']:<40} {r['kind']:<9} {r['reclamations']:>9} {r['exited']:>7} "
            f"{r['killed']:>7} {r['overrun']:>7} {r['share']:>7.2%}  "
            f"{'FLAGGED' if r['flagged'] else '-'}"
        )
    lines.append(
        f"budget {reply.budget:.2%} of at least {reply.min_reclamations} reclamations; flagged "
        f"images {'kept off' if reply.no_spot_for_flagged else 'allowed on'} spot nodes"
    )
    print(shown(lines))
    return 0


async def local(args: Any) -> int:
    try:
        answer = await control_socket.request(args.socket, args.command)
    except PermissionError:
        say(f"{PROG}: {args.socket}: permission denied (root or group spotdrain only)")
        return 1
    except (OSError, TimeoutError) as e:
        say(f"{PROG}: cannot reach the agent at {args.socket}: {e}")
        return 1
    if args.json:
        print(json.dumps(answer, sort_keys=True))
        return 0 if answer.get("ok") else 1
    if not answer.get("ok"):
        say(f"{PROG}: refused: {answer.get('error')}")
        return 1
    print(render_status(answer))
    return 0


ADMIN_COMMANDS = {
    "events": events,
    "timeline": timeline,
    "workers": workers,
    "nodes": nodes,
    "node": node,
    "reputation": reputation,
    "models": models,
    "workloads": workloads,
}


async def run(args: Any) -> int:
    if args.command in ("pause", "resume", "status"):
        return await local(args)
    args.coordinators = replicas(args)
    wait = args.leader_wait_s
    try:
        if args.command == "rentals":
            return await rentals(
                LeaderStub(args.coordinators, pb_grpc.RentalsStub, "Rentals", wait), args
            )
        return await ADMIN_COMMANDS[args.command](
            LeaderStub(args.coordinators, pb_grpc.AdminStub, "Admin", wait), args
        )
    except grpc.aio.AioRpcError as e:
        say(f"{PROG}: coordinator {args.coordinator}: {e.code().name}: {e.details()}")
        return 1
    finally:
        await args.coordinators.close()


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
