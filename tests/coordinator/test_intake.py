"""One node's event batches get a fair share of the coordinator's loop (coordinator/api/intake.py):
the budget on a fake clock, and the stream reader waiting out a flood before it takes a batch
in, whole, a slice at a time."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from spotdrain.coordinator.api.agent_link import AgentLinkServicer, Coordinator
from spotdrain.coordinator.api.intake import EVENT_MIN_COST, Intake, batch_cost
from spotdrain.coordinator.store import open_store
from spotdrain.v1 import spotdrain_pb2 as pb

MIB = 1024 * 1024


def test_a_reclamations_events_never_wait() -> None:
    """A hundred small events now and then: inside the burst, no wait, whatever the pace."""
    intake = Intake(rate_per_s=512 * 1024, burst=2 * MIB)
    assert all(intake.take(batch_cost(30_000, 100), now) == 0.0 for now in range(0, 100, 5))


def test_a_flood_is_held_to_the_rate_once_the_burst_is_spent() -> None:
    """1 MiB batches back to back: two go at once (the 2 MiB burst), then each waits 2 s
    (1 MiB at 512 KiB/s) counted from when the last one was let in."""
    intake = Intake(rate_per_s=512 * 1024, burst=2 * MIB)
    now = 100.0
    assert intake.take(MIB, now) == 0.0
    assert intake.take(MIB, now) == 0.0
    waits = []
    for _ in range(4):
        wait = intake.take(MIB, now)
        waits.append(wait)
        now += wait  # the stream waits, then sends the next at once
    assert waits == [pytest.approx(2.0)] * 4


def test_an_idle_stream_earns_back_no_more_than_the_burst() -> None:
    """After an hour of silence: the burst again, not an hour's worth of bytes."""
    intake = Intake(rate_per_s=512 * 1024, burst=2 * MIB)
    intake.take(2 * MIB, 0.0)
    assert intake.take(2 * MIB, 3600.0) == 0.0
    assert intake.take(MIB, 3600.0) == pytest.approx(2.0)


def test_many_small_events_cost_their_per_event_work() -> None:
    """500 events of 20 bytes cost 500 KiB of the budget, not 10 KB: each event's checks and
    conversion are the work, whatever its size."""
    assert batch_cost(10_000, 500) == 500 * EVENT_MIN_COST
    assert batch_cost(MIB, 500) == MIB


@pytest.mark.parametrize("rate, burst", [(0, 1), (1, -1), (math.nan, 1), (1, math.inf)])
def test_a_budget_that_is_not_a_positive_number_is_refused(rate: float, burst: float) -> None:
    with pytest.raises(ValueError, match="must be a positive number"):
        Intake(rate, burst)


def batch(node_id: str, n: int) -> pb.EventBatch:
    return pb.EventBatch(
        events=[
            pb.Event(uid=f"u-{i}", kind="k", node_id=node_id, wall_time=1.0, details_json="{}")
            for i in range(n)
        ]
    )


async def test_the_stream_waits_out_its_budget_then_takes_the_batch_in_whole(
    tmp_path: Path,
) -> None:
    """A stream past its budget: the reader waits (the stream is not read meanwhile) for what
    the budget says, then converts the whole batch, yielding the loop between slices; nothing
    is dropped."""
    store = await open_store(str(tmp_path / "coordinator.sqlite"))
    servicer = AgentLinkServicer(Coordinator(store, insecure=True))
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        await asyncio.sleep(0)

    intake = Intake(rate_per_s=1000 * EVENT_MIN_COST, burst=100 * EVENT_MIN_COST, sleep=sleep)
    first = await servicer._take_in("node-a", batch("node-a", 100), None, intake)
    assert [e.uid for e in first] == [f"u-{i}" for i in range(100)]
    assert sleeps == [0, 0]  # within the burst: two slices of 50, no wait
    sleeps.clear()
    second = await servicer._take_in("node-a", batch("node-a", 120), None, intake)
    assert len(second) == 120
    # 120 events at 1,000 a second, less what the budget earned back since the first batch
    assert 0.1 < sleeps[0] <= 0.12
    assert sleeps[1:] == [0, 0, 0]  # then three slices
    await store.close()
