"""The replica's lease shell (coordinator/replicas/leadership.py) over a backend that misbehaves: a
rebuild that fails, a lease statement that raises something the store did not expect. Either way the
replica must not hold on to a broken state: it steps down (and exits) or tries again."""

from __future__ import annotations

import asyncio

from spotdrain.coordinator.replicas.leadership import Replica


class Backend:
    """The lease statements a replica makes, in memory; `acquire_errors` raise first, in turn."""

    on_fenced = None

    def __init__(self, acquire_errors: list[Exception] | None = None) -> None:
        self.acquire_errors = list(acquire_errors or [])
        self.term = 0
        self.fences: list[tuple[str, object]] = []

    def holder_for(self, advertise: str) -> str:
        return f"{advertise} 0123456789ab"

    def fence_off(self, why: str) -> None:
        self.fences.append(("off", why))

    def fence_to(self, term: int, holder: str, ttl: float) -> None:
        self.fences.append(("to", term))

    async def acquire_lease(self, holder: str, ttl: float, renew_s: float):  # noqa: ANN201
        if self.acquire_errors:
            raise self.acquire_errors.pop(0)
        self.term += 1
        return True, self.term, holder, ttl

    async def renew_lease(self, holder: str, term: int, ttl: float, timeout: float) -> bool:
        return term == self.term

    async def lease_holder(self, renew_s: float):  # noqa: ANN201
        return self.term, "", 0.0


class Store:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend


def replica(backend: Backend, exits: list[int], renew_s: float) -> Replica:
    """A replica whose deposed exit is recorded in `exits` at once, not the test process's end."""
    return Replica(
        Store(backend),  # type: ignore[arg-type]
        "127.0.0.1:7443",
        ttl_s=1.0,
        renew_s=renew_s,
        step_down_exit_s=0.0,
        exit_deposed=exits.append,
    )


async def test_a_rebuild_that_fails_steps_down_instead_of_holding_the_lease() -> None:
    backend, exits = Backend(), []
    replica_ = replica(backend, exits, renew_s=0.2)

    async def rebuild(term: int) -> None:
        raise RuntimeError("the store went away mid-rebuild")

    await asyncio.wait_for(replica_.run(rebuild), 10)  # returns: it stepped down
    assert not replica_.ready.is_set() and not replica_.serving()
    assert ("to", 1) in backend.fences
    assert backend.fences[-1][0] == "off" and "rebuild of term 1 failed" in str(backend.fences[-1])
    await asyncio.sleep(0)  # the exit is scheduled at once (step_down_exit_s 0 here)
    assert exits == [1]


async def test_a_lease_statement_that_raises_is_tried_again() -> None:
    """Something the store did not map to a StoreError: the try counts as failed and the next
    comes, rather than the replica waiting for an answer that never arrives."""
    backend, exits = Backend(acquire_errors=[ValueError("not enough values to unpack")]), []
    replica_ = replica(backend, exits, renew_s=0.05)
    rebuilt: list[int] = []

    async def rebuild(term: int) -> None:
        rebuilt.append(term)

    running = asyncio.create_task(replica_.run(rebuild))
    try:
        await asyncio.wait_for(replica_.ready.wait(), 10)
        assert rebuilt == [1] and replica_.serving()
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    assert exits == []
