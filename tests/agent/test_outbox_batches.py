"""The agent's outbox batches fit the coordinator's bounds (spotdrain.protocol.limits): the
coordinator refuses a larger EventBatch with RESOURCE_EXHAUSTED, and a refused batch would be
resent, and refused, forever. Nothing accepted into the outbox is ever lost on the way."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from fakes.waiting import eventually
from spotdrain.agent.config import AgentConfig
from spotdrain.agent.drain import link as link_module
from spotdrain.agent.drain.link import CoordinatorLink, batches, to_pb
from spotdrain.agent.drain.outbox import Outbox
from spotdrain.protocol.events import EventRecord
from spotdrain.protocol.limits import (
    MAX_AGENT_MESSAGE_BYTES,
    MAX_BATCH_BYTES,
    MAX_BATCH_EVENTS,
    MAX_DETAILS_BYTES,
)
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

NODE = "node-b"


def event(details: dict[str, Any]) -> pb.Event:
    """An Event as it goes on the wire; built directly, so the splitter can be shown events of
    any size (to_pb would bound its details)."""
    return pb.Event(
        uid=str(uuid.uuid4()),
        kind="container_exited",
        node_id=NODE,
        reclaim_id="r-1",
        wall_time=time.time(),
        t_offset_s=1.5,
        details_json=json.dumps(details, sort_keys=True),
    )


def wire_bytes(batch: list[pb.Event]) -> int:
    """What the coordinator measures: the AgentMessage carrying the batch (>= the EventBatch)."""
    return pb.AgentMessage(events=pb.EventBatch(events=batch)).ByteSize()


def within_bounds(batch: list[pb.Event]) -> bool:
    return 0 < len(batch) <= MAX_BATCH_EVENTS and wire_bytes(batch) <= MAX_BATCH_BYTES


def uids(events: list[pb.Event]) -> list[str]:
    return [e.uid for e in events]


# --- the splitter --------------------------------------------------------------------------


def test_an_agent_back_from_a_long_outage_sends_5000_events_in_batches_of_at_most_500():
    """An agent back from a long outage holds 5,000 small events: they go out in order, in
    batches of at most MAX_BATCH_EVENTS, none of them smaller than it needs to be."""
    events = [event({"exit_code": i % 256, "container": f"c-{i}"}) for i in range(5000)]
    split = list(batches(events))
    assert all(within_bounds(b) for b in split)
    assert [len(b) for b in split] == [MAX_BATCH_EVENTS] * (5000 // MAX_BATCH_EVENTS)
    assert [u for b in split for u in uids(b)] == uids(events)


def test_events_with_large_details_are_cut_by_bytes_not_only_by_count():
    """Three hundred events each carrying 60 KiB of details (allowed: under
    MAX_DETAILS_BYTES) are 18 MB together: every batch stays within MAX_BATCH_BYTES, and each
    is as full as it can be (the next event would have broken the bound)."""
    events = [event({"log": f"{i:05d}" + "x" * (60 * 1024)}) for i in range(300)]
    split = list(batches(events))
    assert len(split) > 1 and all(within_bounds(b) for b in split)
    for batch, following in zip(split, split[1:], strict=False):
        assert wire_bytes([*batch, following[0]]) > MAX_BATCH_BYTES
    assert [u for b in split for u in uids(b)] == uids(events)


def test_one_event_too_large_to_share_a_batch_goes_alone_between_its_neighbours():
    """An event that fits a batch only by itself (nearly MAX_BATCH_BYTES) goes alone; the
    small events before and after it go in their own batches, in order."""
    before = [event({"n": i}) for i in range(3)]
    # Leaves 10 bytes of the batch's room: less than any small event takes.
    blob = "y" * (MAX_BATCH_BYTES - 10 - wire_bytes([event({"blob": ""})]) - 3)
    huge = event({"blob": blob})
    after = [event({"n": i}) for i in range(3, 6)]
    assert MAX_BATCH_BYTES - 20 < wire_bytes([huge]) <= MAX_BATCH_BYTES
    split = list(batches([*before, huge, *after]))
    assert [uids(b) for b in split] == [uids(before), [huge.uid], uids(after)]
    assert all(within_bounds(b) for b in split)


def test_a_batch_cut_at_the_exact_byte_bound_is_accepted():
    """The splitter counts the wire bytes exactly: a batch that fills MAX_BATCH_BYTES to the
    byte is one batch, one byte more makes two."""
    first = event({"n": 0})
    room = MAX_BATCH_BYTES - wire_bytes([first])
    # Grow the second event until the pair lands exactly on the bound.
    pad = room - 300
    while wire_bytes([first, event({"p": "z" * pad})]) < MAX_BATCH_BYTES:
        pad += 1
    exact = event({"p": "z" * pad})
    assert wire_bytes([first, exact]) == MAX_BATCH_BYTES
    assert [len(b) for b in batches([first, exact])] == [2]
    over = event({"p": "z" * (pad + 1)})
    assert [len(b) for b in batches([first, over])] == [1, 1]


def test_no_events_make_no_batches():
    assert list(batches([])) == []


# --- the outbox bounds details -------------------------------------------------------------


def test_an_event_with_oversized_details_is_stored_as_a_summary_and_logged(tmp_path, caplog):
    """A container's exit event carries 200 KB of log tail. The outbox stores it with a summary
    instead (the coordinator would refuse it forever): the short top-level fields stay, the size
    is recorded, and a warning names the node, the kind and the size."""
    outbox = Outbox(tmp_path / "outbox.db")
    details = {"exit_code": 137, "container": "c-9", "oom": True, "log_tail": "e" * 200_000}
    size = len(json.dumps(details, sort_keys=True))
    with caplog.at_level(logging.WARNING, logger="spotdrain.agent.drain.outbox"):
        put = outbox.put(outbox.event("container_exited", NODE, "r-1", time.time(), 2.0, details))
    [stored] = outbox.pending()
    assert stored.uid == put.uid
    assert stored.details == {
        "details_truncated": True,
        "original_bytes": size,
        "exit_code": 137,
        "container": "c-9",
        "oom": True,
    }
    assert len(to_pb(stored).details_json.encode()) <= MAX_DETAILS_BYTES
    [record] = [r for r in caplog.records if r.name == "spotdrain.agent.drain.outbox"]
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    assert NODE in message and "container_exited" in message and str(size) in message
    outbox.close()


def test_details_at_the_bound_are_kept_as_they_are(tmp_path, caplog):
    """Details exactly MAX_DETAILS_BYTES long are allowed: stored unchanged, nothing logged."""
    outbox = Outbox(tmp_path / "outbox.db")
    empty = len(json.dumps({"log": ""}))
    details = {"log": "k" * (MAX_DETAILS_BYTES - empty)}
    assert len(json.dumps(details, sort_keys=True)) == MAX_DETAILS_BYTES
    with caplog.at_level(logging.WARNING, logger="spotdrain.agent.drain.outbox"):
        outbox.put(outbox.event("note", NODE, "", time.time(), None, details))
    assert outbox.pending()[0].details == details
    assert not [r for r in caplog.records if r.name == "spotdrain.agent.drain.outbox"]
    outbox.close()


def test_a_summary_of_many_short_fields_stays_bounded(tmp_path):
    """Oversized details made of 20,000 short fields: the summary keeps some of them, never
    enough to break MAX_DETAILS_BYTES itself; long keys and nested values are left out."""
    outbox = Outbox(tmp_path / "outbox.db")
    details: dict[str, Any] = {f"k{i:05d}": i for i in range(20_000)}
    details["nested"] = {"a": 1}
    details["x" * 100] = 1
    outbox.put(outbox.event("note", NODE, "", time.time(), None, details))
    [stored] = outbox.pending()
    assert stored.details["details_truncated"] is True
    assert "nested" not in stored.details and "x" * 100 not in stored.details
    assert "k00000" in stored.details
    assert len(to_pb(stored).details_json.encode()) <= MAX_DETAILS_BYTES
    outbox.close()


def test_an_oversized_event_an_older_agent_left_in_the_outbox_is_sent_as_a_summary(tmp_path):
    """An outbox written before details were bounded may hold an oversized event: it is sent
    as a summary, not refused on every resend."""
    outbox = Outbox(tmp_path / "outbox.db")
    old = EventRecord(
        uid="old-1",
        kind="container_exited",
        node_id=NODE,
        reclaim_id="r-0",
        wall_time=1.0,
        t_offset_s=None,
        details={"exit_code": 1, "log_tail": "o" * 100_000},
    )
    outbox.db.execute(
        "INSERT INTO outbox (uid, body) VALUES (?, ?)",
        (old.uid, json.dumps(old.__dict__, sort_keys=True)),
    )
    [sent] = [to_pb(e) for e in outbox.pending()]
    assert sent.uid == "old-1"
    assert json.loads(sent.details_json)["exit_code"] == 1
    assert len(sent.details_json.encode()) <= MAX_DETAILS_BYTES
    outbox.close()


# --- through a real gRPC stream --------------------------------------------------------------


class RecordingLink(pb_grpc.AgentLinkServicer):
    """A coordinator reduced to what the agent's stream needs: it registers the node, records
    every EventBatch it receives and acks its uids."""

    def __init__(self, on_batch: Callable[[], None]) -> None:
        self.batches: list[list[pb.Event]] = []
        self.on_batch = on_batch

    async def Connect(  # noqa: N802 (gRPC method name)
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: Any
    ) -> AsyncIterator[pb.CoordinatorMessage]:
        async for msg in request_iterator:
            which = msg.WhichOneof("body")
            if which == "register":
                yield pb.CoordinatorMessage(registered=pb.Registered(node_id=msg.register.node_id))
            elif which == "events":
                batch = list(msg.events.events)
                self.batches.append(batch)
                self.on_batch()
                yield pb.CoordinatorMessage(ack=pb.EventAck(uids=[e.uid for e in batch]))


async def test_a_backlog_of_2000_varied_events_reaches_the_coordinator_once_in_order(
    tmp_path: Path,
):
    """An agent's outbox holds 2,000 events of varied sizes (a few hundred bytes to 60 KiB,
    some above MAX_DETAILS_BYTES) when its stream comes up: the coordinator receives every uid
    once, in outbox order, in batches none of which breaks a bound, and the outbox empties."""
    outbox = Outbox(tmp_path / "outbox.db")
    rng = random.Random(7)
    put: list[str] = []
    for i in range(2000):
        size = rng.choice([100, 400, 2_000, 20_000, 60 * 1024, 90_000])
        details = {"seq": i, "pad": "p" * size}
        put.append(outbox.put(outbox.event("note", NODE, "", time.time(), None, details)).uid)

    received = asyncio.Event()
    servicer = RecordingLink(
        on_batch=lambda: received.set() if sum(map(len, servicer.batches)) >= 2000 else None
    )
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_AGENT_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_AGENT_MESSAGE_BYTES),
        ]
    )
    pb_grpc.add_AgentLinkServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    cfg = AgentConfig(
        coordinator=f"127.0.0.1:{port}",
        node_id=NODE,
        notice_file=tmp_path / "notice.json",
        state_dir=tmp_path,
        docker_host="",
        insecure=True,
    )

    async def registration() -> pb.Register:
        return pb.Register(node_id=NODE)

    link = CoordinatorLink(cfg, outbox, registration)
    running = asyncio.create_task(link.run())
    try:
        await asyncio.wait_for(received.wait(), timeout=30)
        # The acks reach the agent's outbox on their own task: a bounded wait for them.
        await eventually(lambda: len(outbox) == 0, "the outbox to empty")
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await link.close()
        await server.stop(grace=None)
        outbox.close()

    arrived = [e.uid for b in servicer.batches for e in b]
    assert arrived == put
    assert len(servicer.batches) > 2000 // MAX_BATCH_EVENTS  # the byte bound cut too
    broken = [(len(b), wire_bytes(b)) for b in servicer.batches if not within_bounds(b)]
    assert broken == []
    for b in servicer.batches:
        assert all(len(e.details_json.encode()) <= MAX_DETAILS_BYTES for e in b)


def test_a_long_free_text_report_is_shortened_not_refused():
    """The coordinator refuses any string over limits.MAX_STRING_CHARS (and the stream with it):
    a Docker error of 10,000 characters goes out cut to that length instead."""
    from spotdrain.agent.drain.link import _short
    from spotdrain.protocol import limits

    report = _short({"state": "stopped", "reason": "x" * 10_000, "exit_code": 137})
    assert len(report["reason"]) == limits.MAX_STRING_CHARS and report["reason"].endswith("...")
    assert report["state"] == "stopped" and report["exit_code"] == 137


class HoldingLink(RecordingLink):
    """RecordingLink with a Taint that waits for the test's word, and the order in which the
    coordinator saw things: the Taint, each worker report, each event batch."""

    def __init__(self) -> None:
        super().__init__(on_batch=lambda: self.seen.append("events"))
        self.seen: list[str] = []
        self.answer = asyncio.Event()

    async def Connect(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        async def reports_noted() -> AsyncIterator[pb.AgentMessage]:
            async for msg in request_iterator:
                if msg.WhichOneof("body") == "worker":
                    self.seen.append(f"report {msg.worker.worker_id}")
                yield msg

        async for reply in super().Connect(reports_noted(), context):
            yield reply

    async def Taint(self, request: pb.TaintRequest, context: Any) -> pb.TaintReply:  # noqa: N802
        self.seen.append("taint")
        await self.answer.wait()
        return pb.TaintReply()


@contextlib.asynccontextmanager
async def linked(
    tmp_path: Path, hold_events_max_s: float = link_module.HOLD_EVENTS_MAX_S
) -> AsyncIterator[tuple[CoordinatorLink, HoldingLink, Outbox]]:
    """An agent's link, registered with a HoldingLink on a real gRPC server."""
    outbox = Outbox(tmp_path / "outbox.db")
    servicer = HoldingLink()
    server = grpc.aio.server()
    pb_grpc.add_AgentLinkServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    cfg = AgentConfig(
        coordinator=f"127.0.0.1:{port}",
        node_id=NODE,
        notice_file=tmp_path / "notice.json",
        state_dir=tmp_path,
        docker_host="",
        insecure=True,
    )

    async def registration() -> pb.Register:
        return pb.Register(node_id=NODE)

    link = CoordinatorLink(cfg, outbox, registration, hold_events_max_s=hold_events_max_s)
    running = asyncio.create_task(link.run())
    try:
        await asyncio.wait_for(link.connected.wait(), 10)
        yield link, servicer, outbox
    finally:
        servicer.answer.set()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await link.close()
        await server.stop(grace=None)
        outbox.close()


async def test_a_drain_holding_the_events_lets_its_taint_and_reports_through(tmp_path):
    """While a drain holds the stream's events (its SIGTERM round), a Taint call and
    everything else on the stream still go, and the events follow the release. Shown by
    order: two worker reports sent one after the other during the hold both reach the
    coordinator with no batch before them, though the event was in the outbox first."""
    async with linked(tmp_path) as (link, servicer, outbox):
        link.hold_events("r-1")
        taint = asyncio.create_task(link.taint("r-1", "notice", timeout=30))
        await eventually(lambda: "taint" in servicer.seen, "the Taint at the coordinator")
        uid = outbox.put(outbox.event("notice_received", NODE, "r-1", time.time(), 0.0, {})).uid
        link.wake()
        link.report_worker("w-1", {"state": "started"})
        await eventually(lambda: "report w-1" in servicer.seen, "the first report")
        link.report_worker("w-2", {"state": "started"})
        await eventually(lambda: "report w-2" in servicer.seen, "the second report")
        servicer.answer.set()
        await asyncio.wait_for(taint, 10)
        link.report_worker("w-3", {"state": "started"})
        await eventually(lambda: "report w-3" in servicer.seen, "a report after the answer")
        assert servicer.seen == ["taint", "report w-1", "report w-2", "report w-3"]

        link.release_events("r-1")
        await eventually(lambda: servicer.batches, "the events after the release")
        assert [e.uid for e in servicer.batches[0]] == [uid]


async def test_a_hold_never_released_ends_by_itself(tmp_path):
    """A drain that never releases its hold (a round wedged on a hung engine) holds the
    events back for HOLD_EVENTS_MAX_S at most: they reach the coordinator without a release."""
    async with linked(tmp_path, hold_events_max_s=0.3) as (link, servicer, outbox):
        link.hold_events("r-2")
        held_at = time.monotonic()
        uid = outbox.put(outbox.event("notice_received", NODE, "r-2", time.time(), 0.0, {})).uid
        link.wake()
        await eventually(lambda: servicer.batches, "the events once the hold ran out")
        assert time.monotonic() - held_at >= 0.3
        assert [e.uid for e in servicer.batches[0]] == [uid]
