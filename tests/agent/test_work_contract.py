"""The work-manager contract (agent/workloads/managers.py), one text run against each backend
on the real thing: DockerWork over the tests' private Docker engine, SlurmWork over the test
cluster's node sd-n1. Each backend's adapter below only starts units and takes its daemon
away; every scenario reads the same for both."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fakes.dockerenv import run_workload
from fakes.slurm import SlurmCluster
from fakes.waiting import eventually
from spotdrain.agent.core.reclamation_events import ContainerExited, ContainerSignalled, Event
from spotdrain.agent.workloads.docker_engine import DockerEngine
from spotdrain.agent.workloads.managers import DockerWork, Hold, WorkManager
from spotdrain.agent.workloads.settings import SlurmSettings
from spotdrain.agent.workloads.slurm import SlurmWork

NOTHING: frozenset[str] = frozenset()
BOUND_S = 15.0  # only stops a broken test from hanging; never what a scenario measures

# Slurm units: short loops, so a trap runs within 0.1 s of its signal (bash runs it once the
# foreground sleep ends; scancel signals the sleep too).
SLURM_SCRIPTS = {
    "exits_on_term": 'trap "echo TERM; exit 0" TERM\necho ready\nwhile :; do sleep 0.1; done\n',
    "ignores_term": 'trap "echo TERM ignored" TERM\necho ready\nwhile :; do sleep 0.1; done\n',
}


class DockerBackend:
    """Units are labelled test containers; the daemon goes away by pointing an engine with the
    same node and the same inventory at a unix socket nothing listens on."""

    kind = "batch"  # run_workload's drain kind
    records_signals = True  # the engine's own kill events
    keeps_schedule = False  # the coordinator's taint is Docker's cordon: nothing on the engine

    def __init__(self, engine: Any, prefix: str, tmp_path: Path) -> None:
        self.client = engine.client
        self.prefix = prefix
        self.dead_socket = f"unix://{tmp_path}/nothing-listens.sock"
        self.engine = DockerEngine(engine.host, prefix, call_timeout_s=5.0)
        self.manager: WorkManager = DockerWork(self.engine)
        self.started = 0

    async def start(self, behaviour: str) -> str:
        self.started += 1
        container = await asyncio.to_thread(
            run_workload,
            self.client,
            name=f"{self.prefix}{self.started}",
            node_id=self.prefix,
            kind=behaviour,
        )
        return str(container.id)

    async def heard_term(self, unit: str) -> bool:
        logs = await asyncio.to_thread(self.client.containers.get(unit).logs)
        return b"SIGTERM ignored" in logs

    async def held(self) -> bool:
        return False

    @contextlib.asynccontextmanager
    async def unreachable(self) -> AsyncIterator[WorkManager]:
        await self.engine.refresh_inventory()  # as the agent keeps it in the background
        dead = DockerEngine(self.dead_socket, self.prefix, call_timeout_s=0.5)
        dead.inventory = dict(self.engine.inventory)
        try:
            yield DockerWork(dead)
        finally:
            dead.close()

    async def close(self) -> None:
        self.manager.close()
        self.engine.close()


class SlurmBackend:
    """Units are batch jobs bound to one node; the daemon goes away by freezing slurmctld (calls
    to it hang until their timeout, as on a wedged controller), the node's slurmd still runs."""

    kind = "slurm"
    records_signals = False  # Slurm keeps no record of who was signalled
    keeps_schedule = True  # DRAIN
    node = "sd-n1"

    def __init__(self, cluster: SlurmCluster) -> None:
        self.cluster = cluster
        self.notes: list[tuple[str, Event]] = []
        settings = SlurmSettings(
            node_name=self.node, bin_dir=cluster.bin_dir, conf=cluster.conf, call_timeout_s=2
        )
        self.manager: WorkManager = SlurmWork(
            settings, note=lambda rid, event: self.notes.append((rid, event))
        )

    async def start(self, behaviour: str) -> str:
        job = await asyncio.to_thread(
            self.cluster.submit, SLURM_SCRIPTS[behaviour], self.node, name=behaviour
        )
        await eventually(lambda: "ready" in self.cluster.output(job), f"job {job}'s trap")
        return f"slurm:{job}"

    async def heard_term(self, unit: str) -> bool:
        return "TERM ignored" in self.cluster.output(int(unit.removeprefix("slurm:")))

    async def held(self) -> bool:
        """DRAIN (draining or drained) with spotdrain's reason, as the controller shows it."""
        line = await asyncio.to_thread(
            self.cluster.cli, "scontrol", "-o", "show", "node", self.node
        )
        fields = dict(t.partition("=")[::2] for t in line.split() if "=" in t)
        return "DRAIN" in fields["State"] and line.partition("Reason=")[2].startswith("spotdrain:")

    @contextlib.asynccontextmanager
    async def unreachable(self) -> AsyncIterator[WorkManager]:
        self.cluster.freeze_controller()
        try:
            yield self.manager
        finally:
            self.cluster.thaw_controller()

    async def close(self) -> None:
        self.manager.close()
        await asyncio.to_thread(self.cluster.reset)


@pytest.fixture(params=["docker", "slurm"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "docker":
        engine = request.getfixturevalue("docker_engine")
        made: Any = DockerBackend(engine, request.getfixturevalue("containers"), tmp_path)
    else:
        made = SlurmBackend(request.getfixturevalue("slurm_cluster"))
    try:
        yield made
    finally:
        await made.close()


def hold(reclaim_id: str) -> Hold:
    now = time.time()
    return Hold(reclaim_id, grace_deadline=now + 60, terminate_at=now + 120)


async def listed(manager: WorkManager, unit: str) -> Any:
    found = [u for u in await manager.targets(NOTHING, NOTHING) if u.id == unit]
    assert len(found) == 1, f"{unit} listed {len(found)} times"
    return found[0]


async def signalled(manager: WorkManager, targets: list[Any], signal: str) -> list[Any]:
    return [r async for r in manager.signal_each(targets, signal)]


async def exited(manager: WorkManager, unit: Any) -> ContainerExited:
    return await asyncio.wait_for(manager.wait_exit(unit.id, unit.name), BOUND_S)


def lifts(backend: Any) -> list[str]:
    """The reclamations whose lift the manager recorded, in order."""
    return [rid for rid, e in backend.notes if getattr(e, "kind", "") == "manager_uncordoned"]


async def test_a_started_unit_is_listed_looked_at_and_owned(backend) -> None:
    """Unit ids are unique across managers: the one that lists a unit owns it."""
    manager = backend.manager
    unit = await backend.start("exits_on_term")
    assert manager.owns(unit)
    assert (await listed(manager, unit)).id == unit
    look = await manager.look()
    assert unit in look.running and not look.error


async def test_a_cordon_holds_new_work_until_every_reclamation_lifts_it(backend) -> None:
    """The cordon lands without stopping what runs; a second reclamation's hold keeps it
    after the first is lifted; the last lift frees the node, recorded once, for that one."""
    manager = backend.manager
    unit = await backend.start("exits_on_term")
    await asyncio.wait_for(manager.cordon(hold("r-1")), BOUND_S)
    assert await backend.held() == backend.keeps_schedule
    assert unit in (await manager.look()).running  # a cordon stops nothing

    manager.uncordon("r-1")
    await eventually(backend.held, "the lift", ok=lambda held: not held)

    await asyncio.wait_for(manager.cordon(hold("r-2")), BOUND_S)
    await asyncio.wait_for(manager.cordon(hold("r-3")), BOUND_S)
    manager.uncordon("r-2")
    assert await backend.held() == backend.keeps_schedule
    manager.uncordon("r-3")
    await eventually(backend.held, "the last lift", ok=lambda held: not held)
    if backend.keeps_schedule:
        # The barrier for r-2's lift that must not have happened: r-3's, recorded after it.
        await eventually(lambda: lifts(backend), "r-3's lift recorded", ok=lambda x: "r-3" in x)
        assert lifts(backend) == ["r-1", "r-3"]


async def test_a_unit_that_exits_on_sigterm_leaves_the_node_empty(backend) -> None:
    manager = backend.manager
    unit = await backend.start("exits_on_term")
    await asyncio.wait_for(manager.cordon(hold("r-1")), BOUND_S)
    target = await listed(manager, unit)

    results = await signalled(manager, [target], "SIGTERM")
    assert [(type(r), r.container, r.signal, r.error, r.kind) for r in results] == [
        (ContainerSignalled, unit, "SIGTERM", "", backend.kind)
    ]
    gone = await exited(manager, target)
    assert isinstance(gone, ContainerExited) and (gone.container, gone.exit_code) == (unit, 0)
    look = await manager.look()
    assert (look.running, look.error) == ((), "")
    assert await backend.held() == backend.keeps_schedule


async def test_a_unit_ignoring_sigterm_runs_on_until_sigkill(backend) -> None:
    manager = backend.manager
    unit = await backend.start("ignores_term")
    await asyncio.wait_for(manager.cordon(hold("r-1")), BOUND_S)

    [term] = await signalled(manager, [await listed(manager, unit)], "SIGTERM")
    assert term.error == ""
    await eventually(lambda: backend.heard_term(unit), "the unit to hear its SIGTERM")
    assert unit in (await manager.look()).running

    target = await listed(manager, unit)  # what is left at G, listed again
    [kill] = await signalled(manager, [target], "SIGKILL")
    assert (kill.container, kill.signal, kill.error) == (unit, "SIGKILL", "")
    gone = await exited(manager, target)
    assert (gone.container, gone.exit_code) == (unit, 137)  # 128 + 9: killed (docs/workloads.md)
    look = await manager.look()
    assert (look.running, look.error) == ((), "")


async def test_an_unreachable_daemon_is_an_error_and_units_are_listed_locally(backend) -> None:
    unit = await backend.start("exits_on_term")
    async with backend.unreachable() as manager:
        look = await manager.look()
        assert look.error, f"an unreachable daemon looked empty: {look}"
        assert unit in [u.id for u in await manager.targets(NOTHING, NOTHING)]
        assert await manager.delivered(time.time() - 60, time.time(), {unit}) is None


async def test_without_the_daemon_sigterm_reaches_the_units_process(backend) -> None:
    """The drain cannot wait for a daemon that does not answer: the SIGTERM goes to the unit's
    process itself; the cordon lands and the exit is seen once the daemon is back."""
    unit = await backend.start("exits_on_term")
    async with backend.unreachable() as manager:
        cordoned = manager.cordon(hold("r-1"))
        target = await listed(manager, unit)
        [term] = await signalled(manager, [target], "SIGTERM")
        assert (term.container, term.signal, term.via, term.error) == (unit, "SIGTERM", "pid", "")
    manager = backend.manager
    await asyncio.wait_for(cordoned, BOUND_S)
    assert (await exited(manager, target)).container == unit
    look = await manager.look()
    assert (look.running, look.error) == ((), "")


async def test_a_restarted_agent_learns_which_sigterms_were_delivered(backend) -> None:
    """Of the SIGTERMs a previous agent process announced: the unit signalled counts, the one
    never signalled does not; a manager that keeps no record says it cannot tell (None)."""
    manager = backend.manager
    told = await backend.start("exits_on_term")
    untold = await backend.start("exits_on_term")
    since = time.time()
    await signalled(manager, [await listed(manager, told)], "SIGTERM")
    answer = await manager.delivered(since, time.time(), {told, untold})
    assert answer == ({told} if backend.records_signals else None)


async def test_skipped_units_and_kinds_are_left_out_of_the_targets(backend) -> None:
    manager = backend.manager
    first = await backend.start("exits_on_term")
    second = await backend.start("exits_on_term")
    assert {u.id for u in await manager.targets(NOTHING, NOTHING)} == {first, second}
    assert [u.id for u in await manager.targets(frozenset({first}), NOTHING)] == [second]
    assert await manager.targets(NOTHING, frozenset({backend.kind})) == []
