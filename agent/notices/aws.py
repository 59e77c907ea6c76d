"""AWS: the instance metadata service, IMDSv2 (a session token on every read).

- `spot/instance-action` ({"action": "terminate"|"stop"|"hibernate", "time": ISO}; 404 when
  none) is a notice with D = its time. AWS gives no id, and an instance is interrupted once per
  boot (a stopped one comes back with a new boot), so it is keyed by this boot's id: a document
  re-read, re-stamped or rewritten is the same interruption, heard again (the reclamation keeps
  the earliest D, docs/notice-sources.md).
- `events/recommendations/rebalance` ({"noticeTime": ISO}) is an advisory, one per boot too.
- `events/maintenance/scheduled` (a list of {Code, EventId, NotBefore, NotAfter, State, ...},
  dates like "21 Jan 2019 09:00:43 GMT") gives an advisory per event; State canceled or
  completed, or the event gone from the list, withdraws it.

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
from spotdrain.agent.notices.base import Advisory, Health, Sink, boot_id
from spotdrain.agent.notices.metadata_http import ReadFailed, Reply, fetch, session
from spotdrain.agent.notices.settings import check_keys, endpoint, number

TOKEN_TTL_S = 21600  # the longest AWS allows
TOKEN_RENEW_BEFORE_S = 60.0
INSTANCE_ACTION = "/latest/meta-data/spot/instance-action"
REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
MAINTENANCE = "/latest/meta-data/events/maintenance/scheduled"
OVER = ("canceled", "completed")
SPOT_ACTIONS = ("terminate", "stop", "hibernate")  # all AWS writes in an instance-action


@dataclass(frozen=True)
class Config:
    endpoint: str = "http://169.254.169.254"
    poll_s: float = 1.0
    timeout_s: float = 0.5  # per read; the endpoint is on the host's own link

    @classmethod
    def from_table(cls, table: dict[str, Any], where: str) -> Config:
        check_keys(table, {"endpoint", "poll_s", "timeout_s"}, where, "aws")
        return cls(
            endpoint=endpoint(
                table.get("endpoint"), f"{where}sources.aws.endpoint", cls.endpoint
            ),  # fmt: skip
            poll_s=number(table.get("poll_s", cls.poll_s), f"{where}sources.aws.poll_s", 0.1, 60),
            timeout_s=number(
                table.get("timeout_s", cls.timeout_s), f"{where}sources.aws.timeout_s", 0.05, 30
            ),  # fmt: skip
        )


def parse_instance_action(body: bytes, boot: str) -> Notice | NoticeInvalid:
    """This boot's interruption: its identity is the boot's, whatever `time` the document names
    (and whatever id or source it carries: a notice file's fields mean nothing here)."""
    parsed = parse_notice(body)
    if parsed is None:
        return NoticeInvalid("spot/instance-action: empty document", content_hash(body))
    if isinstance(parsed, NoticeInvalid):
        return parsed
    if parsed.action not in SPOT_ACTIONS:
        return NoticeInvalid(f"spot/instance-action: action {parsed.action!r} is not one of "
                             f"{', '.join(SPOT_ACTIONS)}", content_hash(body.strip()))  # fmt: skip
    return Notice(key=f"aws:instance-action:{boot}", notice_id=f"aws-instance-action-{boot[:8]}",
                  action=parsed.action, terminate_at=parsed.terminate_at,
                  source="aws-instance-action")  # fmt: skip


def parse_rebalance(body: bytes, boot: str) -> Advisory | NoticeInvalid:
    """AWS gives one rebalance recommendation per boot (its noticeTime may be re-stamped)."""
    try:
        doc = json.loads(body)
        notice_time = str(doc["noticeTime"])[:64]
        _iso(notice_time)
    except (ValueError, KeyError, TypeError) as e:
        return NoticeInvalid(f"rebalance recommendation: not a document we read ({e})",
                             content_hash(body))  # fmt: skip
    return Advisory(key=f"aws:rebalance:{boot}", source="aws", reason="rebalance",
                    detail=f"noticeTime {notice_time}")  # fmt: skip


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
            out.append(Advisory(
                key=f"aws:maintenance:{event_id}", source="aws", reason="maintenance",
                not_before=_aws_date(event.get("NotBefore")), withdrawn=state in OVER,
                detail=f"{event.get('Code', '')}: {event.get('Description', '')}"[:200],
            ))  # fmt: skip
        return out
    except (ValueError, KeyError, TypeError) as e:
        return NoticeInvalid(f"scheduled maintenance: not a document we read ({e})",
                             content_hash(body))  # fmt: skip


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
    ) -> None:
        self.cfg = cfg
        self.sink = sink
        self.clock = clock
        self.health = Health(self.name, sink, clock)
        self.boot = boot()
        self._token = ""
        self._token_until = 0.0
        self._last_action: Notice | NoticeInvalid | None = None
        self._last_invalid: dict[str, NoticeInvalid] = {}
        self._advised: set[str] = set()  # advisories shown now, by key

    async def run(self) -> None:
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
        reply = await self._get(http, INSTANCE_ACTION)
        if reply.status == 200:
            parsed = parse_instance_action(reply.body, self.boot)
            if parsed != self._last_action:
                self._last_action = parsed
                self.sink.notice(parsed)
        elif reply.status == 404:
            self._last_action = None
        else:
            raise ReadFailed(f"GET {INSTANCE_ACTION}: HTTP {reply.status}")
        shown: dict[str, Advisory] = {}
        for path in (REBALANCE, MAINTENANCE):
            reply = await self._get(http, path)
            if reply.status == 404:
                continue
            if reply.status != 200:
                raise ReadFailed(f"GET {path}: HTTP {reply.status}")
            result = (parse_rebalance(reply.body, self.boot) if path == REBALANCE
                      else parse_maintenance(reply.body))  # fmt: skip
            if isinstance(result, NoticeInvalid):
                if self._last_invalid.get(path) != result:
                    self._last_invalid[path] = result
                    self.sink.notice(result)
                # An unreadable list withdraws nothing: what it showed before still stands.
                shown.update({k: Advisory(k, "aws", _reason(k)) for k in self._advised
                              if _path_of(k) == path})  # fmt: skip
                continue
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

    async def _get(self, http: aiohttp.ClientSession, path: str) -> Reply:
        for attempt in (1, 2):
            token = await self._token_for(http, renew=attempt == 2)
            headers = {"X-aws-ec2-metadata-token": token}
            reply = await fetch(http, "GET", self.cfg.endpoint + path, headers, self.cfg.timeout_s)
            if reply.status != 401:
                return reply
        raise ReadFailed(f"GET {path}: HTTP 401 with a fresh token")

    async def _token_for(self, http: aiohttp.ClientSession, renew: bool) -> str:
        now = self.clock()
        if renew or not self._token or now >= self._token_until - TOKEN_RENEW_BEFORE_S:
            reply = await fetch(http, "PUT", self.cfg.endpoint + "/latest/api/token",
                                {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
                                self.cfg.timeout_s)  # fmt: skip
            token = reply.body.decode("ascii", "replace").strip()
            if reply.status != 200 or not token or len(token) > 4096:
                raise ReadFailed(f"PUT /latest/api/token: HTTP {reply.status}")
            self._token, self._token_until = token, now + TOKEN_TTL_S
        return self._token


def _path_of(key: str) -> str:
    return REBALANCE if key.startswith("aws:rebalance:") else MAINTENANCE


def _reason(key: str) -> str:
    return "rebalance" if key.startswith("aws:rebalance:") else "maintenance"
