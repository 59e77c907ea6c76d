"""Protobuf to domain values and back: the one place the coordinator reads the wire.

Everything that comes in is bounded and checked here (sizes, counts, finite numbers, JSON that
decodes to an object), so the code below the servicers never sees a value it must distrust.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from spotdrain.coordinator.api.errors import BadRequest, TooLarge
from spotdrain.coordinator.api.operations import ContractsReport, ModelStatus, NodeStatus
from spotdrain.coordinator.core import messages as msg
from spotdrain.coordinator.core import reputation
from spotdrain.coordinator.core import worker_machine as wm
from spotdrain.coordinator.core.rental import Rental
from spotdrain.coordinator.fleet.route_table import RouteEntry
from spotdrain.coordinator.store import EventRow, NewEvent, TaintRow
from spotdrain.protocol import cloud, limits
from spotdrain.protocol.events import event_message
from spotdrain.v1 import spotdrain_pb2 as pb

MAX_ID_CHARS = 256


def check_id(value: str, what: str, required: bool = True) -> str:
    if required and not value:
        raise BadRequest(f"{what} is required")
    if len(value) > MAX_ID_CHARS:
        raise BadRequest(f"{what} is {len(value)} characters, at most {MAX_ID_CHARS}")
    return value


def finite(value: float, what: str) -> float:
    if not math.isfinite(value):
        raise BadRequest(f"{what} must be a finite number, got {value}")
    return value


# Strings with a bound of their own, checked where they are read (None: not by check_request).
OWN_BOUNDS: dict[str, int | None] = {"spotdrain.v1.Event.details_json": None}


def check_request(message: Message, where: str = "") -> None:
    """Every string and repeated field of a request within limits.MAX_STRING_CHARS and
    limits.MAX_REPEATED, at any depth: before a servicer sees it (coordinator/api/rejections.py), so
    no handler echoes, stores or logs an unbounded string of the caller's."""
    for field, value in message.ListFields():
        name = f"{where}.{field.name}" if where else field.name
        if field.is_repeated and len(value) > limits.MAX_REPEATED:
            raise TooLarge(f"{name} has {len(value)} elements, at most {limits.MAX_REPEATED}")
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry:
                for key, item in value.items():
                    _check_string(f"{name} key", key)
                    if isinstance(item, Message):
                        check_request(item, f"{name}[{key!r}]")
                    else:
                        _check_string(f"{name}[{key!r}]", item)
            elif field.is_repeated:
                for i, item in enumerate(value):
                    check_request(item, f"{name}[{i}]")
            else:
                check_request(value, name)
        elif field.type == FieldDescriptor.TYPE_STRING:
            bound = OWN_BOUNDS.get(field.full_name, limits.MAX_STRING_CHARS)
            for i, item in enumerate(value) if field.is_repeated else [(None, value)]:
                _check_string(name if i is None else f"{name}[{i}]", item, bound)


def _check_string(name: str, value: object, bound: int | None = limits.MAX_STRING_CHARS) -> None:
    if bound is not None and isinstance(value, str) and len(value) > bound:
        raise BadRequest(f"{name[:100]} is {len(value)} characters, at most {bound}")


T = TypeVar("T")
M = TypeVar("M", bound=Message)


# --- from agents -----------------------------------------------------------------------------


def _taken(cls: type[T], message: Message, **checked: Any) -> T:
    """A `cls` from `message`'s fields of the same names, `checked` replacing those that are
    read through a check."""
    fields = {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}
    return cls(**(fields | checked))


def worker_report(r: pb.WorkerReport) -> msg.WorkerReport:
    return _taken(msg.WorkerReport, r, worker_id=check_id(r.worker_id, "worker_id"))


def rental_report(r: pb.RentalReport) -> msg.RentalReport:
    return _taken(
        msg.RentalReport,
        r,
        rental_id=check_id(r.rental_id, "rental_id"),
        reclaim_id=check_id(r.reclaim_id, "reclaim_id", required=False),
        reclaim_at=finite(r.reclaim_at, "reclaim_at"),
    )


def worker_slots(s: pb.WorkerSlots) -> msg.WorkerSlots:
    return msg.WorkerSlots(s.worker_id, s.slots_in_use, s.capacity, s.claimed_state)


def registration(reg: pb.Register) -> msg.Registration:
    gpus = tuple(
        {"index": g.index, "uuid": g.uuid, "name": g.name, "memory_bytes": g.memory_bytes}
        for g in reg.gpus
    )
    return msg.Registration(
        node_id=check_id(reg.node_id, "node_id"),
        spot=reg.spot,
        node_group=check_id(reg.node_group, "node_group", required=False),
        provider=check_id(reg.provider, "provider", required=False),
        gpus=gpus,
        workers=tuple(worker_report(w) for w in reg.workers),
        rentals=tuple(rental_report(r) for r in reg.rentals),
        inventory_complete=not reg.inventory_incomplete,
        managers=work_managers(reg.managers),
        cloud=cloud_identity(reg.cloud) if reg.HasField("cloud") else None,
    )


def cloud_identity(c: pb.CloudIdentity) -> dict[str, Any]:
    """The node's cloud identity, each value printable and within limits.MAX_CLOUD_CHARS, the
    provider one the agent knows (spotdrain.protocol.cloud)."""
    identity = cloud.as_dict(c)
    why = cloud.problem(identity)
    if why is not None:
        raise BadRequest(f"cloud.{why}")
    return identity


def work_managers(managers: Sequence[pb.WorkManager]) -> tuple[dict[str, str], ...]:
    """The node's work managers, each field printable and within limits.MAX_MANAGER_CHARS;
    a name this coordinator does not know is kept, bounded like the rest."""
    if len(managers) > limits.MAX_MANAGERS:
        raise BadRequest(f"managers: {len(managers)} of them, at most {limits.MAX_MANAGERS}")
    checked = []
    for i, m in enumerate(managers):
        fields = {"name": m.name, "node_name": m.node_name, "cluster": m.cluster}
        if not m.name:
            raise BadRequest(f"managers[{i}].name is required")
        for key, value in fields.items():
            if len(value) > limits.MAX_MANAGER_CHARS or not value.isprintable():
                raise BadRequest(
                    f"managers[{i}].{key} must be printable and at most "
                    f"{limits.MAX_MANAGER_CHARS} characters, got {value[:80]!r}"
                )
        checked.append(fields)
    return tuple(checked)


def _details(ev: pb.Event) -> dict[str, Any]:
    if len(ev.details_json) > limits.MAX_DETAILS_BYTES:
        raise TooLarge(
            f"event {ev.uid}: details are {len(ev.details_json)} bytes, "
            f"at most {limits.MAX_DETAILS_BYTES}"
        )
    if not ev.details_json:
        return {}
    try:
        details = json.loads(ev.details_json)
    except (ValueError, RecursionError) as e:
        # ValueError covers a malformed document and an integer too long to convert.
        raise BadRequest(f"event {ev.uid}: details are not usable JSON: {e}") from None
    if not isinstance(details, dict):
        raise BadRequest(f"event {ev.uid}: details must be a JSON object")
    return details


def check_batch(batch: pb.EventBatch) -> int:
    """An agent's batch's bounds (count and bytes), checked whole before any of it is taken
    in (its events then go through batch_events, a slice at a time); its size in bytes."""
    if len(batch.events) > limits.MAX_BATCH_EVENTS:
        raise TooLarge(
            f"batch of {len(batch.events)} events, at most {limits.MAX_BATCH_EVENTS}: split it"
        )
    size = batch.ByteSize()
    if size > limits.MAX_BATCH_BYTES:
        raise TooLarge(f"batch of {size} bytes, at most {limits.MAX_BATCH_BYTES}: split it")
    return size


def batch_events(node_id: str, batch: Sequence[pb.Event]) -> list[NewEvent]:
    """Events of a batch (or a slice of one) as the store takes them, each checked."""
    events = []
    for ev in batch:
        if not ev.uid or not ev.kind:
            raise BadRequest(f"event {ev.uid!r} is incomplete")
        check_id(ev.uid, "event uid")
        check_id(ev.kind, "event kind")
        check_id(ev.reclaim_id, "event reclaim_id", required=False)
        offset = finite(ev.t_offset_s, "t_offset_s") if ev.HasField("t_offset_s") else None
        events.append(
            NewEvent(
                uid=ev.uid,
                kind=ev.kind,
                node_id=node_id,
                reclaim_id=ev.reclaim_id,
                wall_time=finite(ev.wall_time, "wall_time"),
                t_offset_s=offset,
                details=_details(ev),
                details_json=ev.details_json or "{}",
            )
        )
    return events


# --- to agents -------------------------------------------------------------------------------


def taint_pb(t: TaintRow) -> pb.Taint:
    return pb.Taint(
        key=t.key, effect=t.effect, reclaim_id=t.reclaim_id, reason=t.reason, since=t.since
    )


def command_pb(command: msg.Command) -> pb.CoordinatorMessage:
    match command:
        case msg.StartWorker():
            return pb.CoordinatorMessage(start_worker=pb.StartWorker(**_fields(command)))
        case msg.DrainWorker():
            return pb.CoordinatorMessage(drain_worker=pb.DrainWorker(**_fields(command)))
        case msg.StartRental():
            return pb.CoordinatorMessage(start_rental=pb.StartRental(**_fields(command)))
        case msg.StopRental():
            return pb.CoordinatorMessage(stop_rental=pb.StopRental(**_fields(command)))
        case msg.Registered(node_id=node_id, taints=taints):
            return pb.CoordinatorMessage(
                registered=pb.Registered(node_id=node_id, taints=[taint_pb(t) for t in taints])
            )
        case msg.EventAck(uids=uids):
            return pb.CoordinatorMessage(ack=pb.EventAck(uids=list(uids)))
    raise TypeError(command)


def _fields(command: Any) -> dict[str, Any]:
    return dict(vars(command))


# --- to operators, routers and renters ------------------------------------------------------


def event_pb(row: EventRow) -> pb.StoredEvent:
    event = event_message(row, row.details_json)
    return pb.StoredEvent(id=row.id, event=event, received_at=row.received_at)


def reclamation_pb(record: dict[str, Any]) -> pb.Reclamation:
    rec = pb.Reclamation(
        reclaim_id=record["reclaim_id"],
        node_id=record["node_id"],
        notice_id=record["notice_id"],
        reason=record["reason"],
        source=record["source"],
        t0=record["t0"],
        terminate_at=record["terminate_at"],
        grace_deadline=record["grace_deadline"],
        overrun_at=record["overrun_at"],
        outcome=record["outcome"],
        steps=record["steps"],
    )
    if record["spare_s"] is not None:
        rec.spare_s = record["spare_s"]
    return rec


def node_pb(n: NodeStatus) -> pb.Node:
    row = n.row
    return pb.Node(
        node_id=row.node_id,
        spot=row.spot,
        node_group=row.node_group,
        gpus=[pb.Gpu(**g) for g in row.gpus],
        connected=n.connected_at is not None,
        last_seen=n.connected_at if n.connected_at is not None else row.last_seen,
        taints=[taint_pb(t) for t in n.taints],
        workload_enabled=row.workload_enabled,
        provider=row.owner,
        live_workers=n.live_workers,
        active_rentals=n.active_rentals,
        group_avoided_until=n.avoided_until,
        managers=[pb.WorkManager(**m) for m in row.managers],
        cloud=pb.CloudIdentity(**row.cloud) if row.cloud is not None else None,
    )


def model_pb(m: ModelStatus) -> pb.Model:
    return _filled(pb.Model, m.row, ready=m.ready, starting=m.starting, draining=m.draining)


def reputation_pb(node_id: str, provider: str, score: reputation.Score) -> pb.Reputation:
    return _filled(pb.Reputation, score, node_id=node_id, provider=provider, score=score.value)


def timeline_pb(record: dict[str, Any], events: Sequence[EventRow]) -> pb.Timeline:
    return pb.Timeline(reclamation=reclamation_pb(record), events=[event_pb(r) for r in events])


def contracts_pb(report: ContractsReport) -> pb.ListWorkloadContractsReply:
    contracts = [
        _filled(pb.WorkloadContract, r, share=r.failed_share, flagged=r.flagged_at is not None)
        for r in report.rows
    ]
    return _filled(pb.ListWorkloadContractsReply, report.policy, contracts=contracts)


def _filled(cls: type[M], source: object, **given: Any) -> M:
    """A `cls` message with each field not `given` taken from `source`'s attribute of the same
    name: the message is the list, so a field added to it is not forgotten here. None leaves an
    optional field absent, as the wire means it."""
    message = cls(**given)
    for field in message.DESCRIPTOR.fields:
        if field.name not in given:
            value = getattr(source, field.name)
            if value is not None:
                setattr(message, field.name, value)
    return message


def worker_pb(w: wm.Worker) -> pb.WorkerInfo:
    return _filled(pb.WorkerInfo, w)


def route_pb(e: RouteEntry) -> pb.Route:
    return _filled(pb.Route, e)


def rental_pb(r: Rental) -> pb.Rental:
    return _filled(pb.Rental, r)
