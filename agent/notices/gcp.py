"""Google Cloud: the metadata server, read as hanging GETs (no polling delay at all).

- `instance/preempted`: `TRUE` is a notice with D = T0 + `notice_s` (30 s, the Spot VM's
  shutdown window; the server gives no time), keyed by this boot.
- `instance/maintenance-event`: `TERMINATE_ON_HOST_MAINTENANCE` is a notice with D = T0 +
  `maintenance_notice_s` (the value changes 60 s before the maintenance);
  `MIGRATE_ON_HOST_MAINTENANCE` is an advisory; `NONE` withdraws it.

Each key is read with `?wait_for_change=true&last_etag=E&timeout_sec=N`: the server answers at
once when the value's ETag is no longer E, else when it changes, else after N seconds with the
same ETag. The GET is re-armed after every answer; after an error (with backoff) the next read
is a plain GET, answered at once, so the source is known to be back without waiting for a
change.

The node's identity (agent/notices/identity.py) is read beside the hanging GETs, plain GETs of
`instance/id`, `instance/zone` (`projects/N/zones/ZONE`: the region is the zone less its last
part), `instance/machine-type` (`projects/N/machineTypes/TYPE`), and
`instance/scheduling/preemptible` (`TRUE` for a preemptible or Spot VM) with
`instance/scheduling/provisioning-model` (`SPOT`) where the server has it.

Every answer must carry `Metadata-Flavor: Google`, as Google's own client libraries demand: one
without it is not from the metadata server (a proxy, a captive portal, something else on the
address), so it is a failed read, never a value: the source goes down, nothing is noticed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from spotdrain.agent.core.notice import Notice, NoticeInvalid, content_hash
from spotdrain.agent.notices.base import Advisory, Health, Sink, boot_id
from spotdrain.agent.notices.identity import CloudIdentity, last_segment, read_identity
from spotdrain.agent.notices.metadata_http import ReadFailed, fetch, session
from spotdrain.agent.notices.settings import check_keys, endpoint, number

PREEMPTED = "/computeMetadata/v1/instance/preempted"
MAINTENANCE = "/computeMetadata/v1/instance/maintenance-event"
INSTANCE = "/computeMetadata/v1/instance/"
IDENTITY = ("id", "zone", "machine-type", "scheduling/preemptible")
PROVISIONING_MODEL = "scheduling/provisioning-model"  # newer; a 404 is no answer, not a failure
HEADERS = {"Metadata-Flavor": "Google"}
FLAVOR = ("metadata-flavor", "Google")  # what proves an answer is the metadata server's
MAINTENANCE_VALUES = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")


@dataclass(frozen=True)
class Config:
    endpoint: str = "http://metadata.google.internal"
    notice_s: float = 30.0
    maintenance_notice_s: float = 60.0
    hang_s: float = 60.0  # timeout_sec of each hanging GET; the server answers by then
    timeout_s: float = 2.0  # a plain read (the first, to learn the ETag)

    @classmethod
    def from_table(cls, table: dict[str, Any], where: str) -> Config:
        keys = {"endpoint", "notice_s", "maintenance_notice_s", "hang_s", "timeout_s"}
        check_keys(table, keys, where, "gcp")

        def num(name: str, low: float, high: float) -> float:
            return number(
                table.get(name, getattr(cls, name)), f"{where}sources.gcp.{name}", low, high
            )

        return cls(
            endpoint=endpoint(table.get("endpoint"), f"{where}sources.gcp.endpoint", cls.endpoint),
            notice_s=num("notice_s", 1, 3600),
            maintenance_notice_s=num("maintenance_notice_s", 1, 3600),
            hang_s=num("hang_s", 1, 3600),
            timeout_s=num("timeout_s", 0.05, 30),
        )


class Source:
    name = "gcp"

    def __init__(self, cfg: Config, sink: Sink, clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.sink = sink
        self.clock = clock
        self.health = Health(self.name, sink, clock)
        self.boot = boot_id()
        self._migrating: str | None = None  # the advisory key of a migration announced now

    async def run(self) -> None:
        async with session() as http:
            async with asyncio.TaskGroup() as group:
                group.create_task(read_identity(self.name, self.identity, self.sink))
                group.create_task(self._follow(http, PREEMPTED, self.preempted))
                group.create_task(self._follow(http, MAINTENANCE, self.maintenance))

    async def identity(self) -> CloudIdentity:
        values = {}
        async with session() as http:
            for key in (*IDENTITY, PROVISIONING_MODEL):
                url = self.cfg.endpoint + INSTANCE + key
                reply = await fetch(http, "GET", url, HEADERS, self.cfg.timeout_s)
                if reply.headers.get(FLAVOR[0]) != FLAVOR[1]:
                    raise ReadFailed(f"GET {INSTANCE}{key}: not the metadata server's answer")
                if reply.status == 404 and key == PROVISIONING_MODEL:
                    values[key] = ""
                    continue
                if reply.status != 200:
                    raise ReadFailed(f"GET {INSTANCE}{key}: HTTP {reply.status}")
                values[key] = reply.body.decode("utf-8", "replace").strip()
        zone = last_segment(values["zone"])
        return CloudIdentity(
            "gcp",
            instance_id=values["id"],
            region=zone.rsplit("-", 1)[0] if "-" in zone else "",
            zone=zone,
            instance_type=last_segment(values["machine-type"]),
            spot=values["scheduling/preemptible"] == "TRUE" or values[PROVISIONING_MODEL] == "SPOT",
        )

    async def _follow(
        self, http: aiohttp.ClientSession, path: str, seen: Callable[[str, str], None]
    ) -> None:
        """One key as a chain of hanging GETs; `seen(value, etag)` at the first answer and at
        every answer whose ETag moved."""
        etag = ""
        plain = True  # the first read, and the first after an error: answered at once
        while True:
            if not plain:
                url = (
                    f"{self.cfg.endpoint}{path}?wait_for_change=true&last_etag={etag}"
                    f"&timeout_sec={int(self.cfg.hang_s)}"
                )
                timeout = self.cfg.hang_s + 5.0
            else:
                url, timeout = self.cfg.endpoint + path, self.cfg.timeout_s
            try:
                reply = await fetch(http, "GET", url, HEADERS, timeout)
                if reply.headers.get(FLAVOR[0]) != FLAVOR[1]:
                    why = "without Metadata-Flavor: Google, not the metadata server"
                    raise ReadFailed(f"GET {path}: HTTP {reply.status} {why}")
                if reply.status != 200:
                    raise ReadFailed(f"GET {path}: HTTP {reply.status}")
                new_etag = reply.headers.get("etag", "")
                if not new_etag or len(new_etag) > 128 or not new_etag.isprintable():
                    raise ReadFailed(f"GET {path}: no usable ETag in the answer")
            except ReadFailed as e:
                await asyncio.sleep(self.health.failed(str(e)))
                plain = True  # a hanging GET would only say "up" at the next change
                continue
            plain = False
            self.health.ok()
            if new_etag != etag:
                etag = new_etag
                seen(reply.body.decode("utf-8", "replace").strip()[:200], etag)

    def preempted(self, value: str, etag: str) -> None:
        if value == "FALSE":
            return
        if value != "TRUE":
            self.sink.notice(
                NoticeInvalid(
                    f"instance/preempted: unexpected value {value!r}", content_hash(value.encode())
                )
            )
            return
        self._terminate(
            f"gcp:preempted:{self.boot}", f"gcp-preempted-{self.boot[:8]}", self.cfg.notice_s
        )

    def _terminate(self, key: str, notice_id: str, in_s: float) -> None:
        at = self.clock() + in_s
        notice = Notice(
            key=key, notice_id=notice_id, action="terminate", terminate_at=at, source="gcp"
        )
        self.sink.notice(notice)

    def maintenance(self, value: str, etag: str) -> None:
        if value not in MAINTENANCE_VALUES:
            self.sink.notice(
                NoticeInvalid(
                    f"instance/maintenance-event: unexpected value {value!r}",
                    content_hash(value.encode()),
                )
            )
            return
        if self._migrating and value != "MIGRATE_ON_HOST_MAINTENANCE":
            self.sink.advisory(Advisory(self._migrating, "gcp", "migrate", withdrawn=True))
            self._migrating = None
        if value == "MIGRATE_ON_HOST_MAINTENANCE" and not self._migrating:
            self._migrating = f"gcp:migrate:{self.boot}:{etag}"
            self.sink.advisory(
                Advisory(
                    self._migrating,
                    "gcp",
                    "migrate",
                    not_before=self.clock() + self.cfg.maintenance_notice_s,
                    detail="live migration announced",
                )
            )
        elif value == "TERMINATE_ON_HOST_MAINTENANCE":
            self._terminate(
                f"gcp:maintenance:{self.boot}:{etag}",
                f"gcp-maintenance-{etag[:16]}",
                self.cfg.maintenance_notice_s,
            )
