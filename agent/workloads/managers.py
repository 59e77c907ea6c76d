"""The seam between the drain and whatever runs work on the node: Docker, Slurm, both.

A work manager lists this node's work units (a container, a Slurm job), makes the node
unschedulable in its own terms and lifts that again, signals units, reports their exits as
events and looks at the node for verification. Unit ids are unique across managers (a
container's id; `slurm:<jobid>` for a Slurm job), so the node's core handles them all alike and
never learns which manager holds one. `WorkManagers` fans the drain's calls out to every
manager the host runs; docs/workloads.md says what each one does at each step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from spotdrain.agent.core.reclamation_events import ContainerExited, ContainerSignalled, Event
from spotdrain.agent.workloads.docker_engine import RENTAL_KIND, DockerUnavailable

log = logging.getLogger("spotdrain.agent.workloads")


@dataclass(frozen=True)
class Look:
    """One manager's observation of the node: what still runs, or why it could not tell (an
    error is never "empty": docs/design.md invariant 5)."""

    running: tuple[str, ...] = ()
    rentals: tuple[str, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class Hold:
    """What a reclamation asks of a manager that keeps its own schedule (Slurm's DRAIN)."""

    reclaim_id: str
    grace_deadline: float
    terminate_at: float


# A manager's note for a reclamation's record (its cordon landed, a requeue landed late, a
# warning): (reclaim id, event). The drain feeds it to the node's core like any other event.
Note = Callable[[str, Event], None]


class WorkManager(Protocol):
    """What the drain needs of each manager. Every call returns; a manager that cannot reach
    its daemon answers from what it knows locally (Docker's PID inventory, Slurm's listpids)
    and says so in its events, never by raising into the drain."""

    name: str

    def owns(self, unit_id: str) -> bool: ...

    def cordon(self, hold: Hold) -> asyncio.Future[None]:
        """Make the node unschedulable for this reclamation, retrying in the background until
        it lands; the future resolves when it has (the listing for the first SIGTERM round
        waits for it, up to the taint's 800 ms)."""
        ...

    def uncordon(self, reclaim_id: str) -> None: ...

    async def targets(self, skip: frozenset[str], skip_kinds: frozenset[str]) -> list[Any]: ...

    def signal_each(self, targets: list[Any], signal: str) -> AsyncIterator[ContainerSignalled]: ...

    async def wait_exit(self, unit_id: str, name: str) -> ContainerExited: ...

    async def look(self) -> Look: ...

    async def delivered(self, since: float, until: float, units: set[str]) -> set[str] | None:
        """Of these units a previous agent process announced a SIGTERM for (at `since` or
        later), those the manager says were signalled; None: it cannot tell."""
        ...

    def close(self) -> None: ...


class DockerWork:
    """The Docker engine as a work manager. Its cordon is the coordinator's taint (routes and
    placement stop there); the engine itself has nothing to make unschedulable."""

    name = "docker"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def owns(self, unit_id: str) -> bool:
        return ":" not in unit_id  # a container id is bare hex

    def cordon(self, hold: Hold) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    def uncordon(self, reclaim_id: str) -> None:
        pass

    async def targets(self, skip: frozenset[str], skip_kinds: frozenset[str]) -> list[Any]:
        return list(await self.engine.targets(skip, skip_kinds))

    def signal_each(self, targets: list[Any], signal: str) -> AsyncIterator[ContainerSignalled]:
        return self.engine.signal_each(targets, signal)  # type: ignore[no-any-return]

    async def wait_exit(self, unit_id: str, name: str) -> ContainerExited:
        return await self.engine.wait_exit(unit_id, name)  # type: ignore[no-any-return]

    async def look(self) -> Look:
        try:
            found = await self.engine.running()
        except DockerUnavailable as e:
            return Look(error=f"docker: {e}")
        return Look(tuple(c.id for c in found), tuple(c.id for c in found if c.kind == RENTAL_KIND))

    async def delivered(self, since: float, until: float, units: set[str]) -> set[str] | None:
        told = await self.engine.sigterms_since(since, until)
        return None if told is None else units & told

    def close(self) -> None:
        pass  # the engine is the daemon's, closed by it


class WorkManagers:
    """Every manager the host runs, behind the one interface the drain calls."""

    def __init__(self, managers: Sequence[WorkManager]) -> None:
        if not managers:
            raise ValueError("at least one work manager (docker, slurm)")
        self.managers = tuple(managers)

    def _owner(self, unit_id: str) -> WorkManager:
        for manager in self.managers:
            if manager.owns(unit_id):
                return manager
        raise ValueError(f"no work manager owns unit {unit_id!r}")

    def cordon(self, hold: Hold) -> list[asyncio.Future[None]]:
        return [m.cordon(hold) for m in self.managers]

    def uncordon(self, reclaim_id: str) -> None:
        for manager in self.managers:
            manager.uncordon(reclaim_id)

    async def listed_after(
        self, cordons: list[asyncio.Future[None]], answer_by: float, clock: Callable[[], float]
    ) -> list[Any]:
        """The node's units, listed once every manager's cordon landed or the taint's answer
        deadline passed (a unit started before the cordon is not missed; one after it cannot
        start). A cordon still pending goes on in the background."""
        pending = [c for c in cordons if not c.done()]
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, answer_by - clock()))
        return await self.targets(frozenset(), frozenset())

    async def targets(self, skip: frozenset[str], skip_kinds: frozenset[str]) -> list[Any]:
        listed = await asyncio.gather(*(m.targets(skip, skip_kinds) for m in self.managers))
        return [unit for units in listed for unit in units]

    async def signal_each(
        self, targets: list[Any], signal: str
    ) -> AsyncIterator[ContainerSignalled]:
        """Each manager signals its own units, all at once; results as they come."""
        results: asyncio.Queue[ContainerSignalled | None] = asyncio.Queue()
        groups: dict[str, tuple[WorkManager, list[Any]]] = {}
        for unit in targets:
            manager = self._owner(unit.id)
            groups.setdefault(manager.name, (manager, []))[1].append(unit)

        async def drain(manager: WorkManager, units: list[Any]) -> None:
            try:
                async for result in manager.signal_each(units, signal):
                    results.put_nowait(result)
            finally:
                results.put_nowait(None)

        tasks = [asyncio.create_task(drain(m, units)) for m, units in groups.values()]
        try:
            left = len(tasks)
            while left:
                result = await results.get()
                if result is None:
                    left -= 1
                else:
                    yield result
            for task in tasks:
                task.result()  # a manager's bug is raised, never lost
        finally:
            for task in tasks:
                task.cancel()

    async def wait_exit(self, unit_id: str, name: str) -> ContainerExited:
        return await self._owner(unit_id).wait_exit(unit_id, name)

    async def delivered(self, since: float, until: float, units: set[str]) -> set[str]:
        """Of the SIGTERMs a previous agent process announced, those that count as sent: what
        each manager says was signalled, and all of a manager's that cannot tell (never a
        second SIGTERM: docs/design.md "How the agent carries it out")."""
        out: set[str] = set()
        for manager in self.managers:
            mine = {u for u in units if manager.owns(u)}
            if mine:
                told = await manager.delivered(since, until, mine)
                out |= mine if told is None else told
        return out

    async def look(self) -> Look:
        """Every manager's look, together: the node is empty only when each says so."""
        looks = await asyncio.gather(*(m.look() for m in self.managers))
        return Look(
            tuple(u for look in looks for u in look.running),
            tuple(u for look in looks for u in look.rentals),
            "; ".join(look.error for look in looks if look.error),
        )

    def close(self) -> None:
        for manager in self.managers:
            manager.close()
