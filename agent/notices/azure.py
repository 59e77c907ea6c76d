"""Azure: Scheduled Events from the instance metadata service, polled every `poll_s`.

`GET /metadata/scheduledevents?api-version=2020-07-01` (header `Metadata: true`) returns
{DocumentIncarnation, Events: [{EventId, EventType, Resources, NotBefore, ...}]}. Events whose
Resources name this VM (its name from `/metadata/instance/compute/name`, or `vm_name`):
- `Preempt`, `Terminate`: a notice keyed by EventId, D = NotBefore, or T0 + 30 s when it is
  empty. NotBefore is RFC 1123 in the docs ("Mon, 19 Sep 2016 18:29:47 GMT") and ISO 8601 in
  Microsoft's own mock server ("2026-12-02T18:13:35Z"): both are read (see `parse_not_before`);
- `Reboot`, `Redeploy`, `Freeze`: an advisory;
- an event that leaves the document before its NotBefore was called off: a cancel, unless it
  went ahead first (we acknowledged it, or the platform showed it `Started`).
Each event is judged on its own: one this VM cannot read is reported (`notice_invalid` naming
it) and never hides a readable one beside it, nor counts as gone. Azure defines no proof of
origin on the reply (only the request's `Metadata: true`), so none is checked.
The node's identity (agent/notices/identity.py) is read beside the polls from the compute
document (`/metadata/instance/compute`): `vmId`, `location`, `zone` (a bare number: "1"),
`vmSize`, and `priority` (`Spot`, or the older `Low` of a scale set, is spot).
With `acknowledge = true`, once the node is verified empty the agent POSTs
{"StartRequests": [{"EventId": ...}]} so the platform may go ahead early (`notice_acknowledged`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp

from spotdrain.agent.core.notice import Notice, NoticeInvalid, content_hash, in_range
from spotdrain.agent.notices.base import Advisory, Health, Sink
from spotdrain.agent.notices.identity import CloudIdentity, read_identity
from spotdrain.agent.notices.metadata_http import ReadFailed, fetch, session
from spotdrain.agent.notices.settings import check_keys, endpoint, number
from spotdrain.runtime.cli import UsageError

EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
VM_NAME = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
COMPUTE = "/metadata/instance/compute?api-version=2021-02-01"
HEADERS = {"Metadata": "true"}
NOTICES = {"Preempt", "Terminate"}
ADVISORIES = {"Reboot": "reboot", "Redeploy": "redeploy", "Freeze": "freeze"}
EMPTY_NOT_BEFORE_S = 30.0
# The first read turns Scheduled Events on for the VM, which Azure says can take two minutes.
FIRST_READ_S = 120.0
MAX_EVENTS = 100
# Longer than any date either form writes ("Wed, 30 Sep 2026 18:29:47 GMT" is 29): a longer one
# is refused before a parser sees it.
MAX_DATE_LEN = 64
# ISO 8601 as Azure's tools write it: seconds, an optional fraction (.NET writes 7 digits),
# an optional offset (none means UTC, as every Azure time is).
ISO_DATE = re.compile(
    r"(\d{4}-\d\d-\d\d)[T ](\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:?\d\d)?", re.ASCII
)


@dataclass(frozen=True)
class Config:
    endpoint: str = "http://169.254.169.254"
    poll_s: float = 1.0
    acknowledge: bool = False
    vm_name: str = ""  # empty: ask the metadata service
    timeout_s: float = 2.0

    @classmethod
    def from_table(cls, table: dict[str, Any], where: str) -> Config:
        check_keys(
            table, {"endpoint", "poll_s", "acknowledge", "vm_name", "timeout_s"}, where, "azure"
        )
        ack = table.get("acknowledge", False)
        if not isinstance(ack, bool):
            raise UsageError(f"{where}sources.azure.acknowledge must be true or false")
        vm = table.get("vm_name", "")
        if not isinstance(vm, str) or len(vm) > 128 or not vm.isprintable():
            raise UsageError(f"{where}sources.azure.vm_name must be a short string")
        return cls(
            endpoint=endpoint(
                table.get("endpoint"), f"{where}sources.azure.endpoint", cls.endpoint
            ),
            poll_s=number(table.get("poll_s", cls.poll_s), f"{where}sources.azure.poll_s", 0.1, 60),
            acknowledge=ack,
            vm_name=vm,
            timeout_s=number(
                table.get("timeout_s", cls.timeout_s), f"{where}sources.azure.timeout_s", 0.05, 30
            ),
        )


@dataclass(frozen=True)
class Scheduled:
    """One event of the document, as far as this VM is concerned."""

    event_id: str
    event_type: str
    not_before: float | None
    description: str = ""
    status: str = ""  # EventStatus: Scheduled, Started


@dataclass
class Document:
    incarnation: int
    events: dict[str, Scheduled] = field(default_factory=dict)  # for this VM, by EventId
    # This VM's events that could not be read: each reported on its own, none taken as gone.
    invalid: list[NoticeInvalid] = field(default_factory=list)
    unreadable: set[str] = field(default_factory=set)  # their EventIds, where readable
    anonymous_unreadable: bool = False  # one without a usable EventId: it may be any event


def parse_not_before(raw: object) -> float | None:
    """NotBefore as epoch seconds; None when empty (the platform may act at once). Raises
    ValueError for anything that is not a date in 2000..2200 in either form Azure writes."""
    if raw == "" or raw is None:
        return None
    if not isinstance(raw, str) or len(raw) > MAX_DATE_LEN:
        raise ValueError(f"NotBefore {str(raw)[:MAX_DATE_LEN]!r} is not a date")
    iso = ISO_DATE.fullmatch(raw.strip())
    try:
        if iso:
            day, clock, fraction, offset = iso.groups()
            # At most microseconds: Python's parser takes no more than six digits.
            fraction = f".{fraction[:6]}" if fraction else ""
            offset = "+00:00" if offset in (None, "Z") else offset
            when = datetime.fromisoformat(f"{day}T{clock}{fraction}{offset}")
        else:
            when = parsedate_to_datetime(raw)
            if when.tzinfo is None:
                when = when.replace(tzinfo=UTC)  # "-0000" or no zone: Azure's times are UTC
        seconds = when.timestamp()
    except (TypeError, ValueError, OverflowError, IndexError):
        raise ValueError(f"NotBefore {raw!r} is not a date") from None
    if not in_range(seconds):
        raise ValueError(f"NotBefore {raw!r} is out of range")
    return seconds


def parse_document(body: bytes, vm_name: str) -> Document | NoticeInvalid:
    """The document as far as this VM is concerned. A document that cannot be read as a whole
    is one NoticeInvalid; an event that cannot be read is judged on its own (Document.invalid),
    so it never hides a good Terminate beside it."""

    def invalid(why: str) -> NoticeInvalid:
        return NoticeInvalid(f"scheduled events: {why}", content_hash(body))

    try:
        doc = json.loads(body)
    except ValueError as e:
        return invalid(f"not JSON ({e})")
    if not isinstance(doc, dict) or not isinstance(doc.get("Events"), list):
        return invalid("no Events list")
    incarnation = doc.get("DocumentIncarnation")
    if isinstance(incarnation, bool) or not isinstance(incarnation, int):
        return invalid(f"DocumentIncarnation must be an integer, got {incarnation!r}"[:300])
    out = Document(incarnation)
    for index, ev in enumerate(doc["Events"][:MAX_EVENTS]):
        if not isinstance(ev, dict):
            # Whose it is cannot be told: reported, and nothing is taken as called off.
            out.invalid.append(_bad_event(f"event #{index} is not an object", ev))
            out.anonymous_unreadable = True
            continue
        resources = ev.get("Resources")
        if not isinstance(resources, list) or vm_name not in resources:
            continue  # another VM's event (an availability set shares the document)
        parsed = _parse_event(ev, index)
        if isinstance(parsed, Scheduled):
            out.events[parsed.event_id] = parsed
            continue
        out.invalid.append(parsed)
        event_id = ev.get("EventId")
        if _usable_id(event_id):
            out.unreadable.add(event_id)
        else:
            out.anonymous_unreadable = True
    return out


def _usable_id(event_id: object) -> bool:
    return isinstance(event_id, str) and 0 < len(event_id) <= 128 and event_id.isprintable()


def _bad_event(why: str, ev: object) -> NoticeInvalid:
    raw = json.dumps(ev, sort_keys=True, default=str).encode()
    return NoticeInvalid(f"scheduled events: {why}"[:500], content_hash(raw))


def _parse_event(ev: dict[str, Any], index: int) -> Scheduled | NoticeInvalid:
    """One event for this VM, or why it cannot be read (naming it)."""
    event_id, kind = ev.get("EventId"), ev.get("EventType")
    if not _usable_id(event_id):
        return _bad_event(f"event #{index}: EventId must be a short string, got {event_id!r}", ev)
    if kind not in NOTICES and kind not in ADVISORIES:
        return _bad_event(f"event {event_id}: unknown EventType {kind!r}", ev)
    try:
        not_before = parse_not_before(ev.get("NotBefore"))
    except ValueError as e:
        return _bad_event(f"event {event_id} ({kind}): {e}", ev)
    description = str(ev.get("Description", ""))[:200]
    return Scheduled(event_id, kind, not_before, description, str(ev.get("EventStatus", ""))[:32])


class Source:
    name = "azure"

    def __init__(self, cfg: Config, sink: Sink, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.sink = sink
        self.clock = clock
        self.health = Health(self.name, sink, clock)
        self.vm_name = cfg.vm_name
        self._incarnation: int | None = None
        self._known: dict[str, Scheduled] = {}
        # Events that went ahead (acknowledged by us, or shown Started): gone is not a cancel.
        self._went_ahead: set[str] = set()
        self._invalid: set[str] = set()  # content hashes of what is reported invalid now
        self._acks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(read_identity(self.name, self.identity, self.sink))
            group.create_task(self._poll_forever())

    async def identity(self) -> CloudIdentity:
        async with session() as http:
            reply = await fetch(
                http, "GET", self.cfg.endpoint + COMPUTE, HEADERS, self.cfg.timeout_s
            )
        if reply.status != 200:
            raise ReadFailed(f"GET {COMPUTE}: HTTP {reply.status}")
        try:
            doc = json.loads(reply.body)
            values = {key: doc.get(key, "") for key in ("vmId", "location", "zone", "vmSize")}
            priority = doc.get("priority", "")
        except (ValueError, AttributeError) as e:
            raise ReadFailed(f"GET {COMPUTE}: not a compute document ({e})") from None
        if not all(isinstance(v, str) for v in (*values.values(), priority)):
            raise ReadFailed(f"GET {COMPUTE}: a value that is not a string")
        return CloudIdentity(
            "azure",
            instance_id=values["vmId"],
            region=values["location"],
            zone=values["zone"],
            instance_type=values["vmSize"],
            spot=priority in ("Spot", "Low"),
        )

    async def _poll_forever(self) -> None:
        async with session() as http:
            try:
                due = time.monotonic()
                first = True
                while True:
                    try:
                        await self.poll(http, FIRST_READ_S if first else self.cfg.timeout_s)
                        first = False
                        self.health.ok()
                        due = max(due + self.cfg.poll_s, time.monotonic())
                        wait = due - time.monotonic()
                    except ReadFailed as e:
                        wait = self.health.failed(str(e))
                        due = time.monotonic() + wait
                    await asyncio.sleep(wait)
            finally:
                for task in self._acks:
                    task.cancel()

    async def poll(self, http: aiohttp.ClientSession, timeout_s: float) -> None:
        if not self.vm_name:
            reply = await fetch(http, "GET", self.cfg.endpoint + VM_NAME, HEADERS, timeout_s)
            name = reply.body.decode("utf-8", "replace").strip()
            if reply.status != 200 or not name or len(name) > 128:
                raise ReadFailed(f"GET {VM_NAME}: HTTP {reply.status}")
            self.vm_name = name
        reply = await fetch(http, "GET", self.cfg.endpoint + EVENTS, HEADERS, timeout_s)
        if reply.status != 200:
            raise ReadFailed(f"GET {EVENTS}: HTTP {reply.status}")
        parsed = parse_document(reply.body, self.vm_name)
        if isinstance(parsed, NoticeInvalid):
            self._report_invalid([parsed])
            return
        self._report_invalid(parsed.invalid)
        if parsed.incarnation == self._incarnation:
            return  # nothing changed: the incarnation moves with every change to the document
        self._incarnation = parsed.incarnation
        self.changed(parsed.events, parsed.unreadable, parsed.anonymous_unreadable)

    def _report_invalid(self, found: list[NoticeInvalid]) -> None:
        """Each unreadable thing once while it stays in the document (polled every second)."""
        now = {i.content_hash: i for i in found}
        for digest, invalid in now.items():
            if digest not in self._invalid:
                self.sink.notice(invalid)
        self._invalid = set(now)

    def changed(
        self,
        events: dict[str, Scheduled],
        unreadable: Collection[str] = (),
        anonymous_unreadable: bool = False,
    ) -> None:
        now = self.clock()
        for event_id, ev in events.items():
            if ev.status == "Started":
                self._went_ahead.add(event_id)
            if event_id in self._known:
                continue
            self._known[event_id] = ev
            key = f"azure:{event_id}"
            if ev.event_type in NOTICES:
                deadline = ev.not_before if ev.not_before else now + EMPTY_NOT_BEFORE_S
                self._notice(key, event_id, "terminate", deadline)
                if self.cfg.acknowledge:
                    task = asyncio.get_running_loop().create_task(self._acknowledge(key, ev))
                    self._acks.add(task)
                    task.add_done_callback(self._acks.discard)
            else:
                self.sink.advisory(
                    Advisory(
                        key,
                        "azure",
                        ADVISORIES[ev.event_type],
                        not_before=ev.not_before,
                        detail=ev.description,
                    )
                )
        if anonymous_unreadable:
            return  # an event this VM cannot name may be any known one: none is called off
        # An event still there but unreadable now is not gone: only a missing one is a cancel.
        for event_id in sorted(set(self._known) - set(events) - set(unreadable)):
            ev = self._known.pop(event_id)
            if event_id in self._went_ahead or (ev.not_before is not None and now >= ev.not_before):
                self._went_ahead.discard(event_id)
                continue  # it went ahead; nothing to call off
            key = f"azure:{event_id}"
            if ev.event_type in NOTICES:
                self._notice(key, event_id, "cancel", None)
            else:
                self.sink.advisory(
                    Advisory(key, "azure", ADVISORIES[ev.event_type], withdrawn=True)
                )

    def _notice(self, key: str, event_id: str, action: str, at: float | None) -> None:
        notice = Notice(key=key, notice_id=event_id, action=action, terminate_at=at, source="azure")
        self.sink.notice(notice)

    async def _acknowledge(self, key: str, ev: Scheduled) -> None:
        """Once the node is verified empty, tell the platform it may go ahead now."""
        outcome = await self.sink.settled(key)
        if outcome != "drained":
            return  # overrun, cancelled: not empty by our own check, so no early go-ahead
        body = json.dumps({"StartRequests": [{"EventId": ev.event_id}]})
        async with session() as http:
            for _ in range(5):
                try:
                    reply = await fetch(
                        http,
                        "POST",
                        self.cfg.endpoint + EVENTS,
                        {**HEADERS, "Content-Type": "application/json"},
                        self.cfg.timeout_s,
                        body=body,
                    )
                    if reply.status < 300:
                        self._went_ahead.add(ev.event_id)  # gone from now on: not a cancel
                        self.sink.record(
                            self.name,
                            "notice_acknowledged",
                            {"event_id": ev.event_id, "status": reply.status},
                        )
                        return
                    error = f"HTTP {reply.status}"
                except ReadFailed as e:
                    error = str(e)
                await asyncio.sleep(1.0)
            self.sink.record(
                self.name, "notice_acknowledge_failed", {"event_id": ev.event_id, "error": error}
            )
