"""Every fact in a reclamation's record, once: what the soak (tests/soak) caught the agent
losing or doubling. An exit the engine reports after the node was verified empty, and a cancel
read again by a restarted agent. The drain runner with in-memory adapters, as
tests/agent/test_full_disk.py has them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from test_full_disk import Engine, Gpus, Link, Workers
from test_notice_path import config, running

from fakes.waiting import eventually
from spotdrain.agent.core.notice import Notice
from spotdrain.agent.drain.outbox import Outbox
from spotdrain.agent.drain.runner import DrainRunner
from spotdrain.agent.drain.state import BundleStore
from spotdrain.agent.workloads.docker_engine import ContainerExited


class LateWaitEngine(Engine):
    """The job is gone from the engine's list at once on SIGTERM, but the engine's wait for
    its exit comes back only when the test says so (a busy daemon)."""

    def __init__(self) -> None:
        super().__init__()
        self.wait_returns = asyncio.Event()

    async def wait_exit(self, container_id: str, name: str) -> ContainerExited:
        await self.wait_returns.wait()
        return ContainerExited(time.time(), container_id, name, 0)


def kinds(outbox: Outbox) -> list[str]:
    return [e.kind for e in outbox.pending(limit=1000)]


async def test_an_exit_reported_after_the_node_was_verified_empty_is_recorded(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path)
    outbox = Outbox(cfg.state_dir / "outbox.sqlite")
    engine = LateWaitEngine()
    drains = DrainRunner(cfg, outbox, Link(), engine, Gpus(), Workers())  # type: ignore[arg-type]
    async with running(drains, outbox):
        drains.notice(
            Notice(
                key="late-exit",
                notice_id="late-exit",
                action="terminate",
                terminate_at=time.time() + 20,
                source="file",
            )
        )
        assert await asyncio.wait_for(drains.settled("late-exit"), 5) == "drained"
        await eventually(lambda: not drains.live, "the reclamation finished")
        assert "container_exited" not in kinds(outbox)
        engine.wait_returns.set()
        await eventually(lambda: "container_exited" in kinds(outbox), "the late exit recorded")
        assert kinds(outbox).count("container_exited") == 1


async def test_a_cancel_read_again_after_a_restart_is_recorded_once(tmp_path: Path) -> None:
    """A notice and its cancel, the reclamation lifted; the agent restarts with the cancel still
    in the notice file and reads it again, first while the lift is unanswered, then once more
    after the reclamation finished: one notice_cancelled in all."""

    class Unlifting(Link):
        async def taint_until_answered(self, reclaim_id: str, reason: str, **_: object) -> None:
            if _.get("remove"):
                await asyncio.Event().wait()  # the coordinator never confirms the lift
            self.taints.append(reclaim_id)

    cfg = config(tmp_path)
    outbox = Outbox(cfg.state_dir / "outbox.sqlite")
    notice = Notice(
        key="cx", notice_id="cx", action="terminate", terminate_at=time.time() + 20, source="file"
    )
    cancel = Notice(key="cx", notice_id="cx", action="cancel", terminate_at=None, source="file")
    for run in range(3):
        drains = DrainRunner(
            cfg, outbox, Unlifting() if run < 2 else Link(), Engine(), Gpus(), Workers()
        )  # type: ignore[arg-type]
        loop = asyncio.create_task(drains.run())
        try:
            if run == 0:
                drains.notice(notice)
            drains.notice(cancel)  # run 0: the cancel itself; later runs: read again
            await eventually(lambda: kinds(outbox).count("notice_cancelled") >= 1, "the cancel")
            if run == 2:
                await eventually(lambda d=drains: not d.live, "the lift answered: finished")
                drains.notice(cancel)  # and read once more, after it finished
            await asyncio.sleep(0)
            await eventually(lambda d=drains: d._queue.empty(), "the runner idle")
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
            await drains.close()
    assert kinds(outbox).count("notice_cancelled") == 1
    outbox.close()


async def test_a_cancel_after_an_empty_node_finished_its_drain_lifts_it(tmp_path: Path) -> None:
    """Nothing runs on the node: it is verified empty and the reclamation finishes (drained).
    Then the provider calls the notice off. Nothing was stopped, so the lift is carried out:
    the coordinator is asked to remove the taint, the deadline file goes, the cancel is
    recorded once with lifted true, and once the coordinator confirms the reclamation is
    finished again (not left open, asking after every restart)."""

    class Lifting(Link):
        def __init__(self) -> None:
            super().__init__()
            self.lifted: list[str] = []

        async def taint_until_answered(self, reclaim_id: str, reason: str, **_: object) -> None:
            (self.lifted if _.get("remove") else self.taints).append(reclaim_id)

    cfg = config(tmp_path)
    outbox = Outbox(cfg.state_dir / "outbox.sqlite")
    engine, link = Engine(), Lifting()
    engine.running_now = []
    drains = DrainRunner(cfg, outbox, link, engine, Gpus(), Workers())  # type: ignore[arg-type]
    async with running(drains, outbox):
        drains.notice(
            Notice(
                key="early",
                notice_id="early",
                action="terminate",
                terminate_at=time.time() + 120,
                source="azure",
            )
        )
        assert await asyncio.wait_for(drains.settled("early"), 5) == "drained"
        await eventually(lambda: not drains.live, "the drain finished")
        assert cfg.deadline_file.exists()
        drains.notice(
            Notice(
                key="early", notice_id="early", action="cancel", terminate_at=None, source="azure"
            )
        )
        await eventually(lambda: link.lifted and not drains.live, "the lift confirmed")
        [rec] = drains.recent.values()
        assert rec.lifted and rec.finished and link.lifted == [rec.reclaim_id]
        assert not cfg.deadline_file.exists()
        cancelled = [e.details for e in outbox.pending(limit=1000) if e.kind == "notice_cancelled"]
        assert cancelled == [{"lifted": True, "outcome": "drained"}]
        assert engine.signals == []


async def test_a_step_whose_agent_died_before_the_outbox_loses_no_event(tmp_path: Path) -> None:
    """The agent is killed between writing the bundle of the step that recorded the SIGTERM
    and storing that step's events in the outbox. The restarted agent finds the events in the
    bundle and stores them, once; it sends no second SIGTERM, and the drain finishes."""

    class DyingOutbox(Outbox):
        dead = False

        def put(self, event):  # noqa: ANN001, ANN201
            if event.kind == "sigterm_sent" or self.dead:
                self.dead = True  # the process is gone: nothing reaches SQLite any more
                return event
            return super().put(event)

    class DyingBundles(BundleStore):
        def save(self, rec, events=()):  # noqa: ANN001, ANN201
            return True if outbox.dead else super().save(rec, events)

    cfg = config(tmp_path)
    outbox = DyingOutbox(cfg.state_dir / "outbox.sqlite")
    engine = Engine()
    drains = DrainRunner(
        cfg, outbox, Link(), engine, Gpus(), Workers(), bundles=DyingBundles(cfg.state_dir)
    )  # type: ignore[arg-type]
    async with running(drains, outbox):
        drains.notice(
            Notice(
                key="died",
                notice_id="died",
                action="terminate",
                terminate_at=time.time() + 20,
                source="file",
            )
        )
        await eventually(lambda: outbox.dead, "the agent died after the SIGTERM step's bundle")
    assert "sigterm_sent" not in kinds(Outbox(cfg.state_dir / "outbox.sqlite"))

    again = Outbox(cfg.state_dir / "outbox.sqlite")
    drains = DrainRunner(cfg, again, Link(), engine, Gpus(), Workers())  # type: ignore[arg-type]
    loop = asyncio.create_task(drains.run())
    try:
        assert await asyncio.wait_for(drains.settled("died"), 5) == "drained"
        assert kinds(again).count("sigterm_sent") == 1
        assert [s for s in engine.signals if s[1] == "SIGTERM"] == [(engine.job.id, "SIGTERM")]
        assert kinds(again).count("notice_received") == 1
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await drains.close()
        again.close()
