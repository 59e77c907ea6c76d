"""What every notice source shares: the values a source reports, the sink it reports them to,
and the health bookkeeping (retry with backoff, down after a few failures, up again).

A source is one module with one class: `name`, and `async run(sink)` that reads its provider
until cancelled and never raises for a provider's fault. What it reads becomes a `Notice` or
`NoticeInvalid` (agent/core/notice.py), an `Advisory`, or a health fact; the sink (the agent's
source hub) dedupes across sources and restarts, and turns them into reclamations and events. A
source holds no state that matters across a restart: ids are deterministic, so reading the same
provider document again after a restart is the same reclamation, never a second one (AWS's
count of notices gone within a boot is the one exception, docs/notice-sources.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from spotdrain.agent.core.notice import Notice, NoticeInvalid
from spotdrain.agent.notices.identity import CloudIdentity

# Consecutive failed reads before a source is reported down: one lost packet is not an outage,
# three in a row (about three poll periods) are.
DOWN_AFTER = 3
BACKOFF_FIRST_S = 0.2
# A source that is down keeps retrying at least this often: the notice may come any second.
BACKOFF_MAX_S = 5.0
# Two clock reads further apart than this (the thread was descheduled between them) bound the
# time slept only loosely: read them again.
SLEPT_READ_GAP_NS = 1_000_000
ADVISORY_REASONS = ("rebalance", "maintenance", "migrate", "reboot", "redeploy", "freeze")


@dataclass(frozen=True)
class Advisory:
    """An early warning that prepares without draining: the node is at risk, not reclaimed.

    `withdrawn` means the provider took it back (the document no longer shows it, or a
    maintenance event is canceled/completed)."""

    key: str  # deterministic: the provider's event id, or what identifies the warning
    source: str
    reason: str  # one of ADVISORY_REASONS
    not_before: float | None = None  # when the provider says it may act, if it says
    withdrawn: bool = False
    detail: str = ""

    def __post_init__(self) -> None:
        if self.reason not in ADVISORY_REASONS:
            raise ValueError(f"advisory reason must be one of {ADVISORY_REASONS}")
        if self.not_before is not None and not math.isfinite(self.not_before):
            raise ValueError("advisory not_before must be finite")


class Sink(Protocol):
    """The agent's side of a source (agent/notices/hub.py)."""

    def notice(self, parsed: Notice | NoticeInvalid) -> None: ...

    def advisory(self, advisory: Advisory) -> None: ...

    def record(self, source: str, kind: str, details: dict[str, Any]) -> None:
        """A source's own event (notice_acknowledged, ...), stored and sent like any other."""

    def health_changed(self, health: Health) -> None: ...

    def identity(self, identity: CloudIdentity) -> None:
        """The node's cloud identity, read once (agent/notices/identity.py)."""

    async def settled(self, key: str) -> str:
        """Wait until the reclamation opened by notice `key` is verified empty, or past its
        overrun check, or cancelled; its outcome ("drained", "overrun", "cancelled", ...)."""
        ...


class Health:
    """One source's reachability: `ok()` after each good read, `failed(error)` after each bad
    one, which returns how long to wait before the next try (0.2 s doubling, at most 5 s).

    The transitions are down after DOWN_AFTER failures in a row and up at the first good read
    after that; each is reported once to the sink (notice_source_down / notice_source_up)."""

    def __init__(self, source: str, sink: Sink, clock: Callable[[], float]) -> None:
        self.source = source
        self.sink = sink
        self.clock = clock
        self.up = True  # until shown otherwise: a source starts trusted, then proves broken
        self.failures = 0
        self.error = ""
        self.last_ok: float | None = None
        self.down_since: float | None = None
        # Answers read from the provider (the file source: parses handed on), so an operator
        # or a test can tell a read that changed nothing from one that never came.
        self.reads = 0

    def ok(self) -> None:
        self.reads += 1
        self.last_ok = self.clock()
        self.failures = 0
        self.error = ""
        if not self.up:
            self.up = True
            self.sink.health_changed(self)
            self.down_since = None

    def failed(self, error: str) -> float:
        self.failures += 1
        self.error = error[:500]
        if self.up and self.failures >= DOWN_AFTER:
            self.up = False
            self.down_since = self.clock()
            self.sink.health_changed(self)
        return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self.failures - 1))

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "up": self.up,
            "error": self.error,
            "failures": self.failures,
            "last_ok": self.last_ok,
            "reads": self.reads,
        }


class NoticeSource(Protocol):
    name: str
    cfg: Any  # the source's own Config
    health: Health

    async def run(self) -> None:
        """Read the provider until cancelled; report to the sink given at construction."""
        ...


def boot_id(path: str = "/proc/sys/kernel/random/boot_id") -> str:
    """This boot's id: a notice that can come once per boot (a preemption, the host's own
    shutdown) is keyed by it, so an agent restarted mid-drain finds the same reclamation."""
    try:
        with open(path) as f:
            return f.read().strip()[:64] or "unknown-boot"
    except OSError:
        return "unknown-boot"


def slept_s() -> float:
    """Seconds this boot has spent suspended or hibernated (0.0 where the clocks are not Linux's).

    CLOCK_BOOTTIME counts a suspend and CLOCK_MONOTONIC does not; nothing else moves one against
    the other. The value is read between two monotonic reads, so it is at least the true one and
    at most a read's gap (1 ms, usually well under a microsecond) above it."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is None:
        return 0.0
    best: tuple[int, int] | None = None  # (gap, boottime - monotonic), the tightest read
    for _ in range(10):
        before = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        boot = time.clock_gettime_ns(boottime)
        gap = time.clock_gettime_ns(time.CLOCK_MONOTONIC) - before
        if best is None or gap < best[0]:
            best = (gap, boot - before)
        if gap <= SLEPT_READ_GAP_NS:
            break
    assert best is not None
    return best[1] / 1e9
