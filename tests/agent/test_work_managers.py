"""The drain's one seam over every work manager on the host (agent/workloads/managers.py): a
host running Docker containers beside Slurm jobs is listed, signalled, watched and verified as
one node, each unit by the manager that owns it. The managers here are in-memory fakes of the
protocol; tests/agent/test_work_contract.py runs the real backends against one contract."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from spotdrain.agent.core.reclamation_events import ContainerExited, ContainerSignalled
from spotdrain.agent.workloads.managers import Hold, Look, WorkManagers


@dataclass(frozen=True)
class Unit:
    id: str
    name: str
    kind: str = "batch"
    image: str = ""


class FakeManager:
    """A manager of named units; its cordon lands when the test says so."""

    def __init__(self, name: str, prefix: str, cordon_lands: bool = True) -> None:
        self.name = name
        self.prefix = prefix
        self.units: dict[str, Unit] = {}
        self.signals: list[tuple[str, str]] = []
        self.cordons: list[str] = []
        self.lifted: list[str] = []
        self.cordon_lands = cordon_lands
        self.error = ""
        self.can_tell = True

    def start(self, name: str) -> Unit:
        unit = Unit(f"{self.prefix}{name}", name)
        self.units[unit.id] = unit
        return unit

    def owns(self, unit_id: str) -> bool:
        return unit_id.startswith(self.prefix)

    def cordon(self, hold: Hold) -> asyncio.Future[None]:
        self.cordons.append(hold.reclaim_id)
        landed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.cordon_lands:
            landed.set_result(None)
        return landed

    def uncordon(self, reclaim_id: str) -> None:
        self.lifted.append(reclaim_id)

    async def targets(self, skip: frozenset[str], skip_kinds: frozenset[str]) -> list[Any]:
        return [u for u in self.units.values() if u.id not in skip and u.kind not in skip_kinds]

    async def signal_each(self, targets: list[Any], signal: str) -> AsyncIterator[Any]:
        for unit in targets:
            assert self.owns(unit.id), f"{self.name} was handed {unit.id}"
            self.signals.append((unit.id, signal))
            self.units.pop(unit.id, None)
            yield ContainerSignalled(time.time(), unit.id, unit.name, signal, self.name)

    async def wait_exit(self, unit_id: str, name: str) -> ContainerExited:
        assert self.owns(unit_id)
        return ContainerExited(time.time(), unit_id, name, 0, state=self.name)

    async def look(self) -> Look:
        if self.error:
            return Look(error=f"{self.name}: {self.error}")
        return Look(tuple(self.units))

    async def delivered(self, since: float, until: float, units: set[str]) -> set[str] | None:
        return {u for u in units if u.endswith("-sent")} if self.can_tell else None

    def close(self) -> None:
        pass


def host() -> tuple[FakeManager, FakeManager, WorkManagers]:
    docker, slurm = FakeManager("docker", "c-"), FakeManager("slurm", "slurm:")
    return docker, slurm, WorkManagers([docker, slurm])


HOLD = Hold("rcl-1", grace_deadline=time.time() + 90, terminate_at=time.time() + 120)


async def test_one_round_signals_each_unit_through_the_manager_that_owns_it():
    docker, slurm, work = host()
    docker.start("infer-1")
    slurm.start("101")
    slurm.start("102")
    targets = await work.targets(frozenset(), frozenset())
    results = [r async for r in work.signal_each(targets, "SIGTERM")]
    assert sorted((r.container, r.via) for r in results) == [
        ("c-infer-1", "docker"),
        ("slurm:101", "slurm"),
        ("slurm:102", "slurm"),
    ]
    assert docker.signals == [("c-infer-1", "SIGTERM")]
    assert sorted(slurm.signals) == [("slurm:101", "SIGTERM"), ("slurm:102", "SIGTERM")]
    exited = await work.wait_exit("slurm:101", "101")
    assert exited.state == "slurm"  # answered by the owner


async def test_the_listing_for_the_first_round_comes_after_every_cordon():
    """Slurm's DRAIN lands after Docker's (nothing to do) cordon: a job that started before it
    landed is in the listing, since the listing waits for it."""
    docker, slurm, work = host()
    slurm.cordon_lands = False
    cordons = work.cordon(HOLD)
    assert docker.cordons == slurm.cordons == ["rcl-1"]
    listing = asyncio.create_task(work.listed_after(cordons, time.time() + 30, time.time))
    await asyncio.sleep(0)
    late = slurm.start("103")  # started while the DRAIN was on its way
    assert not listing.done()
    cordons[1].set_result(None)
    assert [u.id for u in await listing] == [late.id]


async def test_a_cordon_not_landed_by_the_answer_deadline_does_not_hold_the_listing():
    """The controller does not answer: the listing goes on at the taint's answer deadline
    (the local taint holds; the DRAIN keeps trying in the background)."""
    docker, slurm, work = host()
    slurm.cordon_lands = False
    job = slurm.start("104")
    cordons = work.cordon(HOLD)
    listed = await work.listed_after(cordons, time.time() + 0.05, time.time)
    assert [u.id for u in listed] == [job.id]
    assert not cordons[1].done()


async def test_the_node_is_empty_only_when_every_manager_says_so():
    docker, slurm, work = host()
    assert await work.look() == Look()
    slurm.error = "controller: no answer within 5 s"
    look = await work.look()
    assert look.error == "slurm: controller: no answer within 5 s"  # never "empty"
    slurm.error = ""
    slurm.start("105")
    docker.start("job-1")
    assert sorted((await work.look()).running) == ["c-job-1", "slurm:105"]


async def test_a_restarted_agent_counts_a_sigterm_sent_where_the_manager_cannot_tell():
    docker, slurm, work = host()
    slurm.can_tell = False
    announced = {"c-a-sent", "c-b", "slurm:106", "slurm:107-sent"}
    delivered = await work.delivered(time.time() - 5, time.time(), announced)
    # Docker's own record says c-b was never asked: it may get its SIGTERM now. Slurm keeps
    # no such record: each of its jobs counts as signalled (never a second SIGTERM).
    assert delivered == {"c-a-sent", "slurm:106", "slurm:107-sent"}


async def test_a_lift_reaches_every_manager():
    docker, slurm, work = host()
    work.cordon(HOLD)
    work.uncordon("rcl-1")
    assert docker.lifted == slurm.lifted == ["rcl-1"]


def test_a_unit_no_manager_owns_is_a_bug_not_a_silent_skip():
    with pytest.raises(ValueError, match="no work manager owns"):
        WorkManagers([FakeManager("docker", "c-")])._owner("slurm:1")
