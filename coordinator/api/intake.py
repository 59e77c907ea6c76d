"""How fast one node's event batches are taken in: its fair share of the one event loop.

A node's batch is checked, converted and stored on the loop that also answers every other
node's `Taint`. One node sending the largest batches as fast as they are acknowledged (an
agent's outbox replaying a long outage, or a broken one) took a quarter of the loop at
10,000 nodes and moved every other node's `Taint` p99 by 30 to 230 ms. So each stream has a
budget, a token bucket of bytes: a batch costs its size, and at least EVENT_MIN_COST per event
(a batch of many small events costs its per-event work). Past the budget the stream is not
read until the bucket has refilled: the agent's next sends wait in HTTP/2's flow control, its
outbox waits for the acknowledgement as it always does, and nothing is refused or lost.

A reclamation's own events (about a hundred, a few hundred bytes each) are far inside the
burst; an outbox of a day's outage (a few MiB) drains in seconds.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

INTAKE_BYTES_PER_S = 512 * 1024
INTAKE_BURST_BYTES = 2 * 1024 * 1024
EVENT_MIN_COST = 1024


def batch_cost(byte_size: int, events: int) -> int:
    """What a batch takes from the budget: its bytes, at least EVENT_MIN_COST per event."""
    return max(byte_size, events * EVENT_MIN_COST)


class Intake:
    """A token bucket on a monotonic clock, pure: `take` says how long to wait. `sleep` is how
    the stream waits it out and yields between slices (a test passes one that records)."""

    def __init__(
        self,
        rate_per_s: float = INTAKE_BYTES_PER_S,
        burst: float = INTAKE_BURST_BYTES,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.validate(rate_per_s, burst)
        self.sleep = sleep
        self.rate, self.burst = float(rate_per_s), float(burst)
        self.tokens = self.burst
        self.at: float | None = None

    @staticmethod
    def validate(rate_per_s: float, burst: float) -> None:
        for name, value in (("rate", rate_per_s), ("burst", burst)):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"intake {name} must be a positive number, got {value!r}")

    def take(self, cost: float, now: float) -> float:
        """Spend `cost` at `now`: the seconds to wait before the batch is taken in (0 within the
        budget). What is waited for is spent already: a stream that waits and then sends
        again at once waits again, by the same measure."""
        if self.at is None:
            self.at = now
        if now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
        self.tokens -= cost
        if self.tokens < 0:
            # `at` becomes when the debt is paid: the bucket refills from there, empty.
            self.at += -self.tokens / self.rate
            self.tokens = 0.0
        return max(0.0, self.at - now)
