"""One preemption heard by two sources (Google's `preempted` and the host's own shutdown come
together, each with its own key): two reclamations, but one machine. A container gets one
SIGTERM whichever sent it, and the workloads' deadline file never moves its G later
(invariant 2). The drain runner with in-memory adapters, as tests/agent/test_full_disk.py has
them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from test_full_disk import NODE, Engine, Gpus, Link, Workers

from fakes.waiting import eventually
from spotdrain.agent.config import AgentConfig
from spotdrain.agent.core.notice import Notice
from spotdrain.agent.core.reclamation import Margins
from spotdrain.agent.drain.outbox import Outbox
from spotdrain.agent.drain.runner import DrainRunner
from spotdrain.agent.workloads.docker_engine import ContainerSignalled


class StubbornEngine(Engine):
    """The job ignores SIGTERM; only SIGKILL ends it."""

    async def signal_each(self, targets: list, signal: str) -> AsyncIterator[ContainerSignalled]:
        for t in targets:
            self.signals.append((t.id, signal))
            if signal == "SIGKILL":
                self.running_now = []
                self.gone.set()
            yield ContainerSignalled(
                time.time(), t.id, t.name, signal, "api", image=t.image, kind=t.kind
            )


def one_machine(
    tmp_path: Path, **settings: Any
) -> tuple[AgentConfig, Outbox, StubbornEngine, DrainRunner]:
    """One node's drain runner over in-memory adapters, its job ignoring SIGTERM."""
    cfg = AgentConfig(
        coordinator="127.0.0.1:1",
        node_id=NODE,
        notice_file=tmp_path / "n.json",
        state_dir=tmp_path / "state",
        insecure=True,
        deadline_file=tmp_path / "workload" / "deadline.json",
        status_dir=tmp_path / "status",
        socket=tmp_path / "agent.sock",
        margins=Margins(grace_s=2, overrun_s=1, observe_every_s=0.05),
        **settings,
    )
    cfg.state_dir.mkdir()
    outbox = Outbox(cfg.state_dir / "outbox.sqlite")
    engine = StubbornEngine()
    drains = DrainRunner(cfg, outbox, Link(), engine, Gpus(), Workers())  # type: ignore[arg-type]
    return cfg, outbox, engine, drains


async def test_one_machine_two_notices_one_sigterm_and_the_earlier_g(tmp_path: Path) -> None:
    cfg, outbox, engine, drains = one_machine(tmp_path)
    loop = asyncio.create_task(drains.run())
    try:
        t0 = time.time()
        drains.notice(
            Notice(
                key="gcp:preempted:boot-1",
                notice_id="gcp-preempted",
                action="terminate",
                terminate_at=t0 + 4,
                source="gcp",
            )
        )
        await eventually(lambda: engine.signals, "the SIGTERM")
        assert engine.signals == [(engine.job.id, "SIGTERM")]
        first_g = json.loads(cfg.deadline_file.read_text())["grace_deadline"]
        # The host's shutdown for the same preemption, with a later D of its own.
        drains.notice(
            Notice(
                key="shutdown:boot-1",
                notice_id="shutdown-boot-1",
                action="terminate",
                terminate_at=t0 + 6,
                source="shutdown",
            )
        )
        outcome = await asyncio.wait_for(drains.settled("gcp:preempted:boot-1"), 10)
        await asyncio.wait_for(drains.settled("shutdown:boot-1"), 10)
        assert outcome in ("drained", "overrun")
        sigterms = [s for s in engine.signals if s[1] == "SIGTERM"]
        assert sigterms == [(engine.job.id, "SIGTERM")]  # one, though two reclamations ran
        assert ("c1" * 32, "SIGKILL") in engine.signals  # G still kills
        assert json.loads(cfg.deadline_file.read_text())["grace_deadline"] <= first_g
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await drains.close()
        outbox.close()


async def test_a_lift_leaves_the_deadline_file_to_the_drain_still_in_force(tmp_path: Path) -> None:
    """An owner's pause and a provider's notice at once; the owner resumes while the notice's
    drain goes on. The workloads' deadline file is not removed with the pause: it names the
    notice's deadlines from then on."""
    cfg, outbox, engine, drains = one_machine(tmp_path, pause_notice_s=4.0)
    loop = asyncio.create_task(drains.run())
    try:
        pause = drains.pause()
        await eventually(lambda: engine.signals, "the SIGTERM")
        assert engine.signals == [(engine.job.id, "SIGTERM")]
        drains.notice(
            Notice(
                key="aws:i-1",
                notice_id="aws-1",
                action="terminate",
                terminate_at=time.time() + 8,
                source="aws-imds",
            )
        )
        await eventually(
            lambda: (
                len(drains.live) == 2 and all(r.phase == "draining" for r in drains.live.values())
            ),
            "both reclamations draining",
        )
        notice = next(r for r in drains.live.values() if r.reclaim_id != pause.reclaim_id)
        assert json.loads(cfg.deadline_file.read_text())["reclaim_id"] == pause.reclaim_id

        assert drains.resume() == [pause.reclaim_id]
        doc = json.loads(cfg.deadline_file.read_text())  # still there, for the notice now
        assert doc["reclaim_id"] == notice.reclaim_id
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await drains.close()
        outbox.close()
