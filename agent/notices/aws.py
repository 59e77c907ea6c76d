"""AWS: the instance metadata service, IMDSv2 (a session token on every read).

- `spot/instance-action` ({"action": "terminate"|"stop"|"hibernate", "time": ISO}; 404 when
  none) is a notice with D = its time. AWS gives no id, so it is keyed by the interruption it
  belongs to (`Occurrence`): this boot's, unless the boot was suspended since (a hibernated
  instance resumes with its boot id) or the last one went away. A document re-read, re-stamped
  or rewritten is the same interruption, heard again (the reclamation keeps the earliest D,
  docs/notice-sources.md).
- `events/recommendations/rebalance` ({"noticeTime": ISO}) is an advisory, keyed the same way.
- `events/maintenance/scheduled` (a list of {Code, EventId, NotBefore, NotAfter, State, ...},
  dates like "21 Jan 2019 09:00:43 GMT") gives an advisory per event; State canceled or
  completed, or the event gone from the list, withdraws it.

The node's identity (agent/notices/identity.py) is read beside the polls from `instance-id`,
`placement/region`, `placement/availability-zone`, `instance-type` and `instance-life-cycle`
(`spot` or `on-demand`), with the same token.

The token is taken with PUT /latest/api/token, renewed a minute before it expires and again at
once when a read answers 401. Polled every `poll_s` (1 s: the path is local and cheap; AWS's own
advice is 5 s, and the common handler's 2 s), on a fixed schedule so a slow read does not push
every later one back.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp

from spotdrain.agent.core.notice import Notice, NoticeInvalid, content_hash, in_range, parse_notice
from spotdrain.agent.notices.base import Advisory, Health, Sink, boot_id, slept_s
from spotdrain.agent.notices.identity import CloudIdentity, read_identity
from spotdrain.agent.notices.metadata_http import ReadFailed, Reply, fetch, session
from spotdrain.agent.notices.settings import check_keys, endpoint, number

TOKEN_TTL_S = 21600  # the longest AWS allows
TOKEN_RENEW_BEFORE_S = 60.0
INSTANCE_ACTION = "/latest/meta-data/spot/instance-action"
REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
MAINTENANCE = "/latest/meta-data/events/maintenance/scheduled"
IDENTITY = {
    "instance_id": "/latest/meta-data/instance-id",
    "region": "/latest/meta-data/placement/region",
    "zone": "/latest/meta-data/placement/availability-zone",
    "instance_type": "/latest/meta-data/instance-type",
    "life_cycle": "/latest/meta-data/instance-life-cycle",
}
OVER = ("canceled", "completed")
SPOT_ACTIONS = ("terminate", "stop", "hibernate")  # all AWS writes in an instance-action
# A signal absent for this many genuine answers in a row (404s, not failed reads) is over, and
# the next one is a new interruption: one or two odd replies do not end a pending one.
GONE_AFTER = 3
# Within one process the time slept moves only by a suspend (seconds at least), never by the
# jitter of reading two clocks.
SLEEP_MOVED_S = 0.5


@dataclass(frozen=True)
class Config:
    endpoint: str = "http://169.254.169.254"
    poll_s: float = 1.0
    timeout_s: float = 0.5  # per read; the endpoint is on the host's own link

    @classmethod
    def from_table(cls, table: dict[str, Any], where: str) -> Config:
        check_keys(table, {"endpoint", "poll_s", "timeout_s"}, where, "aws")
        return cls(
            endpoint=endpoint(table.get("endpoint"), f"{where}sources.aws.endpoint", cls.endpoint),
            poll_s=number(table.get("poll_s", cls.poll_s), f"{where}sources.aws.poll_s", 0.1, 60),
            timeout_s=number(
                table.get("timeout_s", cls.timeout_s), f"{where}sources.aws.timeout_s", 0.05, 30
            ),
        )


class Occurrence:
    """Which occurrence of a signal AWS shows at most once at a time (the instance-action, the
    rebalance recommendation) a read belongs to; AWS gives neither an id. A boot has one until
    it is suspended (the time slept moves: a hibernated instance resumes with its boot id) or
    the signal is gone for GONE_AFTER answers; then the next is another. Pure: reads in, the
    key's suffix out ("" for a boot's first, so its key is the same in every agent lifetime)."""

    def __init__(self) -> None:
        self.slept = 0  # whole seconds this boot had slept at the last read
        self.ended = 0  # occurrences gone since then (kept in memory)
        self.shown = False
        self.absent = 0  # genuine answers in a row without it

    def read(self, slept: int) -> None:
        """A read is about to be made, `slept` seconds into this boot's sleeping."""
        if slept != self.slept:  # a suspend: what was shown before it is over
            self.slept, self.ended, self.shown, self.absent = slept, 0, False, 0

    @property
    def suffix(self) -> str:
        return "" if (self.slept, self.ended) == (0, 0) else f":{self.slept}s:{self.ended}"

    def present(self) -> None:
        self.shown, self.absent = True, 0

    def missing(self) -> bool:
        """A genuine 404; True once nothing is shown any more (over, or never was)."""
        if self.shown:
            self.absent += 1
            if self.absent >= GONE_AFTER:
                self.ended, self.shown, self.absent = self.ended + 1, False, 0
        return not self.shown


def parse_instance_action(body: bytes, boot: str, occurrence: str = "") -> Notice | NoticeInvalid:
    """This boot's interruption (`occurrence`: Occurrence.suffix): its identity is the boot's,
    whatever `time` the document names (and whatever id or source it carries: a notice file's
    fields mean nothing here)."""
    parsed = parse_notice(body)
    if parsed is None:
        return NoticeInvalid("spot/instance-action: empty document", content_hash(body))
    if isinstance(parsed, NoticeInvalid):
        return parsed
    if parsed.action not in SPOT_ACTIONS:
        return NoticeInvalid(
            f"spot/instance-action: action {parsed.action!r} is not one of "
            f"{', '.join(SPOT_ACTIONS)}",
            content_hash(body.strip()),
        )
    return Notice(
        key=f"aws:instance-action:{boot}{occurrence}",
        notice_id=f"aws-instance-action-{boot[:8]}{occurrence.replace(':', '-')}",
        action=parsed.action,
        terminate_at=parsed.terminate_at,
        source="aws-instance-action",
    )


def parse_rebalance(body: bytes, boot: str, occurrence: str = "") -> Advisory | NoticeInvalid:
    """A rebalance recommendation, keyed as the instance-action is (its noticeTime may be
    re-stamped)."""
    try:
        doc = json.loads(body)
        notice_time = str(doc["noticeTime"])[:64]
        _iso(notice_time)
    except (ValueError, KeyError, TypeError) as e:
        return NoticeInvalid(
            f"rebalance recommendation: not a document we read ({e})", content_hash(body)
        )
    return Advisory(
        key=f"aws:rebalance:{boot}{occurrence}",
        source="aws",
        reason="rebalance",
        detail=f"noticeTime {notice_time}",
    )


def parse_maintenance(body: bytes) -> list[Advisory] | NoticeInvalid:
    """Every scheduled event as an advisory; the ones that are over as withdrawn."""
    try:
        doc = json.loads(body)
        if not isinstance(doc, list):
            raise TypeError(f"a list expected, got {type(doc).__name__}")
        out = []
        for event in doc[:100]:
            event_id = str(event["EventId"])[:128]
            state = str(event.get("State", "")).lower()
            out.append(
                Advisory(
                    key=f"aws:maintenance:{event_id}",
                    source="aws",
                    reason="maintenance",
                    not_before=_aws_date(event.get("NotBefore")),
                    withdrawn=state in OVER,
                    detail=f"{event.get('Code', '')}: {event.get('Description', '')}"[:200],
                )
            )
        return out
    except (ValueError, KeyError, TypeError) as e:
        return NoticeInvalid(
            f"scheduled maintenance: not a document we read ({e})", content_hash(body)
        )


def _iso(value: Any) -> float:
    seconds = datetime.fromisoformat(str(value)).timestamp()
    if not in_range(seconds):
        raise ValueError(f"time out of range: {value!r}")
    return seconds


def _aws_date(value: Any) -> float | None:
    if not value:
        return None
    parsed = datetime.strptime(str(value), "%d %b %Y %H:%M:%S GMT").replace(tzinfo=UTC)
    if not in_range(parsed.timestamp()):
        raise ValueError(f"date out of range: {value!r}")
    return parsed.timestamp()


class Source:
    name = "aws"

    def __init__(
        self,
        cfg: Config,
        sink: Sink,
        clock: Callable[[], float] = time.time,
        boot: Callable[[], str] = boot_id,
        slept: Callable[[], float] = slept_s,
    ) -> None:
        self.cfg = cfg
        self.sink = sink
        self.clock = clock
        self.health = Health(self.name, sink, clock)
        self.boot = boot()
        self.slept = slept
        self._slept_at: float | None = None  # the time slept, as last taken to have moved
        self._action = Occurrence()
        self._rebalance = Occurrence()
        self._token = ""
        self._token_until = 0.0
        # The polls and the identity read share one token: whoever finds none takes it alone.
        self._token_lock = asyncio.Lock()
        self._last_action: Notice | NoticeInvalid | None = None
        self._last_invalid: dict[str, NoticeInvalid] = {}
        self._advised: set[str] = set()  # advisories shown now, by key

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(read_identity(self.name, self.identity, self.sink))
            group.create_task(self._poll_forever())

    async def identity(self) -> CloudIdentity:
        """The instance as IMDS describes it; only its id is required (an item AWS does not
        show on some instance is left empty)."""
        values = {}
        async with session() as http:
            for key, path in IDENTITY.items():
                reply = await self._get(http, path)
                if reply.status == 404 and key != "instance_id":
                    values[key] = ""
                    continue
                if reply.status != 200:
                    raise ReadFailed(f"GET {path}: HTTP {reply.status}")
                values[key] = reply.body.decode("utf-8", "replace").strip()
        life_cycle = values.pop("life_cycle")
        return CloudIdentity("aws", **values, spot=life_cycle == "spot")

    async def _poll_forever(self) -> None:
        async with session() as http:
            due = time.monotonic()
            while True:
                try:
                    await self.poll(http)
                    self.health.ok()
                    due += self.cfg.poll_s
                    wait = due - time.monotonic()
                    if wait < 0:  # fell behind (a slow read): start the schedule again
                        due, wait = time.monotonic(), 0.0
                except ReadFailed as e:
                    wait = self.health.failed(str(e))
                    due = time.monotonic() + wait
                await asyncio.sleep(wait)

    async def poll(self, http: aiohttp.ClientSession) -> None:
        """One round: the instance action first (it is the notice), then the advisories."""
        slept = self.slept()
        if self._slept_at is None or abs(slept - self._slept_at) >= SLEEP_MOVED_S:
            self._slept_at = slept
        for occurrence in (self._action, self._rebalance):
            occurrence.read(int(self._slept_at))
        reply = await self._get(http, INSTANCE_ACTION)
        if reply.status == 200:
            parsed = parse_instance_action(reply.body, self.boot, self._action.suffix)
            if isinstance(parsed, Notice):
                self._action.present()
            if parsed != self._last_action:
                self._last_action = parsed
                self.sink.notice(parsed)
        elif reply.status == 404:
            self._action.missing()
            self._last_action = None
        else:
            raise ReadFailed(f"GET {INSTANCE_ACTION}: HTTP {reply.status}")
        shown: dict[str, Advisory] = {}
        for path in (REBALANCE, MAINTENANCE):
            reply = await self._get(http, path)
            if reply.status == 404:
                if path == REBALANCE and not self._rebalance.missing():
                    shown.update(self._still_advised(path))  # not gone for long enough yet
                continue
            if reply.status != 200:
                raise ReadFailed(f"GET {path}: HTTP {reply.status}")
            result = (
                parse_rebalance(reply.body, self.boot, self._rebalance.suffix)
                if path == REBALANCE
                else parse_maintenance(reply.body)
            )
            if isinstance(result, NoticeInvalid):
                if self._last_invalid.get(path) != result:
                    self._last_invalid[path] = result
                    self.sink.notice(result)
                # An unreadable list withdraws nothing: what it showed before still stands.
                shown.update(self._still_advised(path))
                continue
            if path == REBALANCE:
                self._rebalance.present()
            for adv in result if isinstance(result, list) else [result]:
                shown[adv.key] = adv
        for key, adv in shown.items():
            if adv.withdrawn:
                if key in self._advised:
                    self._advised.discard(key)
                    self.sink.advisory(adv)
            elif key not in self._advised:
                self._advised.add(key)
                self.sink.advisory(adv)
        for key in sorted(self._advised - set(shown)):  # gone from the document: withdrawn
            self._advised.discard(key)
            self.sink.advisory(Advisory(key, "aws", _reason(key), withdrawn=True))

    def _still_advised(self, path: str) -> dict[str, Advisory]:
        return {k: Advisory(k, "aws", _reason(k)) for k in self._advised if _path_of(k) == path}

    async def _get(self, http: aiohttp.ClientSession, path: str) -> Reply:
        for attempt in (1, 2):
            token = await self._token_for(http, renew=attempt == 2)
            headers = {"X-aws-ec2-metadata-token": token}
            reply = await fetch(http, "GET", self.cfg.endpoint + path, headers, self.cfg.timeout_s)
            if reply.status != 401:
                return reply
        raise ReadFailed(f"GET {path}: HTTP 401 with a fresh token")

    async def _token_for(self, http: aiohttp.ClientSession, renew: bool) -> str:
        held = self._token
        async with self._token_lock:
            if renew and self._token != held:
                return self._token  # renewed by the other reader while this one waited
            return await self._take_token(http, renew)

    async def _take_token(self, http: aiohttp.ClientSession, renew: bool) -> str:
        now = self.clock()
        if renew or not self._token or now >= self._token_until - TOKEN_RENEW_BEFORE_S:
            reply = await fetch(
                http,
                "PUT",
                self.cfg.endpoint + "/latest/api/token",
                {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
                self.cfg.timeout_s,
            )
            token = reply.body.decode("ascii", "replace").strip()
            if reply.status != 200 or not token or len(token) > 4096:
                raise ReadFailed(f"PUT /latest/api/token: HTTP {reply.status}")
            self._token, self._token_until = token, now + TOKEN_TTL_S
        return self._token


def _path_of(key: str) -> str:
    return REBALANCE if key.startswith("aws:rebalance:") else MAINTENANCE


def _reason(key: str) -> str:
    return "rebalance" if key.startswith("aws:rebalance:") else "maintenance"
