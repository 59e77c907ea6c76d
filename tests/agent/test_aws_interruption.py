"""One AWS interruption, heard many times: the real AWS source polling the suite's IMDS emulator
(tests/fakes/cloudmeta.py), the agent's source hub and its drain runner over in-memory adapters (as
tests/agent/test_one_machine_two_notices.py has them). However often the instance-action is read,
re-stamped or rewritten, it is one reclamation whose D is the earliest heard; an interruption
after the instance hibernated and resumed (same boot id) is another, and drains again."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from test_full_disk import Gpus, Link, Workers
from test_one_machine_two_notices import StubbornEngine, one_machine

from fakes.cloudmeta import AwsImds, ManualClock, iso_utc
from fakes.waiting import eventually
from spotdrain.agent.config import AgentConfig
from spotdrain.agent.drain.outbox import Outbox
from spotdrain.agent.drain.runner import DrainRunner
from spotdrain.agent.notices import aws
from spotdrain.agent.notices.hub import SourceHub
from spotdrain.agent.notices.settings import AdvisoryPolicy

BOOT = "5b1f3c9e-2d47-4e8a-b6f1-0a9c7e3d2b14"
INSTANCE_ACTION = "/latest/meta-data/spot/instance-action"


Machine = tuple[AgentConfig, Outbox, StubbornEngine, DrainRunner]


@contextlib.asynccontextmanager
async def agent_hearing(
    tmp_path: Path,
    imds: AwsImds,
    machine: Machine | None = None,
    slept: Callable[[], float] = lambda: 0.0,
) -> AsyncIterator[tuple[DrainRunner, Outbox]]:
    """The drain loop and the AWS source (polling every 0.1 s) for the length of a scenario;
    `slept`: the seconds this boot has spent suspended, as the host's clocks tell it."""
    cfg, outbox, _engine, drains = machine or one_machine(tmp_path)
    hub = SourceHub(cfg.node_id, drains, AdvisoryPolicy(), cfg.state_dir)
    source = aws.Source(
        aws.Config.from_table({"endpoint": imds.url, "poll_s": 0.1}, ""),
        hub,
        boot=lambda: BOOT,
        slept=slept,
    )
    tasks = [asyncio.create_task(drains.run()), asyncio.create_task(source.run())]
    try:
        yield drains, outbox
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await drains.close()
        outbox.close()


def events(outbox: Outbox, kind: str) -> list[dict[str, Any]]:
    return [e.details for e in outbox.pending(1000) if e.kind == kind]


def heard_again(outbox: Outbox) -> bool:
    """A barrier: the agent has handled a later read, as an update or as a second notice."""
    return bool(events(outbox, "notice_updated")) or len(events(outbox, "notice_received")) > 1


def reads(imds: AwsImds, status: int = 200) -> int:
    return len([s for s in imds.seen if s.path == INSTANCE_ACTION and s.status == status])


def restarted(cfg: AgentConfig) -> Machine:
    """The agent started again on the same state directory (its bundles on disk)."""
    outbox = Outbox(cfg.state_dir / "outbox.sqlite")
    engine = StubbornEngine()
    drains = DrainRunner(cfg, outbox, Link(), engine, Gpus(), Workers())  # type: ignore[arg-type]
    return cfg, outbox, engine, drains


def job_runs_again(engine: StubbornEngine) -> None:
    """The job the last drain killed, started again by its owner after the resume."""
    engine.running_now = [engine.job]
    engine.gone.clear()


def bundles(drains: DrainRunner) -> list[str]:
    return sorted(p.name for p in drains.bundles.dir.glob("rcl-*.json"))


async def test_an_instance_action_re_stamped_on_every_read_is_one_reclamation(tmp_path):
    """AWS's own mock (what aws-node-termination-handler tests with) writes `time` afresh on
    every read. Ten polls later there is still one reclamation, D is the first time heard, and
    the later times are recorded as an update of it, not as notices."""
    wall = itertools.count(time.time(), 1.0)
    with AwsImds(wall=lambda: next(wall)) as imds:
        imds.set_instance_action("terminate", restamp_in_s=120)
        async with agent_hearing(tmp_path, imds) as (drains, outbox):
            await eventually(lambda: events(outbox, "notice_received"), "the notice")
            first = reads(imds)
            # A barrier, not a sleep: ten more reads of a new document each, all handled.
            await imds.await_seen(
                lambda s: s.path == INSTANCE_ACTION and s.status == 200, count=first + 10
            )
            await eventually(lambda: heard_again(outbox), "a later read handled")
            [received] = events(outbox, "notice_received")
            updated = events(outbox, "notice_updated")
            assert len(bundles(drains)) == 1
            assert {u["terminate_at"] for u in updated} == {received["terminate_at"]}
            assert all(u["heard_terminate_at"] > received["terminate_at"] for u in updated)
            assert not any(u["moved"] for u in updated)
            assert len(updated) <= 2  # one record per ten seconds, however many reads


async def test_a_rewrite_to_a_later_time_is_recorded_and_d_stays_the_earliest(tmp_path):
    with AwsImds() as imds:
        t = int(time.time())
        imds.set_instance_action("terminate", iso_utc(t + 60))
        async with agent_hearing(tmp_path, imds) as (drains, outbox):
            await eventually(lambda: events(outbox, "notice_received"), "the notice")
            imds.set_instance_action("terminate", iso_utc(t + 300))
            await eventually(lambda: heard_again(outbox), "a later read handled")
            [received] = events(outbox, "notice_received")
            [updated] = events(outbox, "notice_updated")
            assert received["terminate_at"] == t + 60
            assert (updated["heard_terminate_at"], updated["terminate_at"], updated["moved"]) == (
                t + 300,
                t + 60,
                False,
            )
            assert len(bundles(drains)) == 1


async def test_a_rewrite_to_an_earlier_time_moves_d_earlier_and_the_workloads_see_it(tmp_path):
    """T+300 first, then T+60, while the job (which ignores SIGTERM) still runs: the same
    reclamation now ends at T+60, and so does the workloads' deadline file."""
    with AwsImds() as imds:
        t = int(time.time())
        imds.set_instance_action("terminate", iso_utc(t + 300))
        async with agent_hearing(tmp_path, imds) as (drains, outbox):
            await eventually(lambda: events(outbox, "deadline_file_written"), "the deadline file")
            imds.set_instance_action("terminate", iso_utc(t + 60))
            await eventually(lambda: heard_again(outbox), "a later read handled")
            assert len(events(outbox, "notice_received")) == 1 and len(bundles(drains)) == 1
            [updated] = events(outbox, "notice_updated")
            assert (updated["terminate_at"], updated["moved"]) == (t + 60, True)
            [rec] = drains.live.values()
            assert (rec.terminate_at, rec.grace_deadline) == (t + 60, t + 58)
            deadline = json.loads(drains.cfg.deadline_file.read_text())
            written = (deadline["terminate_at_epoch"], deadline["grace_deadline_epoch"])
            assert written == (t + 60, t + 58)


@pytest.mark.parametrize("counted", [True, False], ids=["sleep-counted", "sleep-not-counted"])
async def test_a_hibernated_instance_resumed_and_interrupted_again_drains_again(tmp_path, counted):
    """A spot instance hibernates on its interruption, is drained, and resumes hours later with
    the same boot id; AWS interrupts it again. The second notice is a reclamation of its own that
    kills the job again, not an update of the finished first one. `sleep-counted`: the kernel
    counts the hibernation (CLOCK_BOOTTIME) and the new notice is there at once; otherwise the
    notice's going away (for aws.GONE_AFTER answers) is what tells one interruption from the
    next."""
    slept = ManualClock(0.0)
    machine = one_machine(tmp_path)
    engine = machine[2]
    with AwsImds() as imds:
        imds.set_instance_action("hibernate", iso_utc(time.time() + 3))
        async with agent_hearing(tmp_path, imds, machine, slept) as (drains, outbox):
            await eventually(lambda: events(outbox, "drained"), "the first drain", timeout=15)
            gone = reads(imds, 404)
            imds.resume()
            job_runs_again(engine)
            if counted:
                slept.advance(6 * 3600.0)
            else:  # a barrier: the agent has read the notice gone GONE_AFTER times
                await imds.await_seen(
                    lambda s: s.path == INSTANCE_ACTION and s.status == 404,
                    count=gone + aws.GONE_AFTER,
                )
            imds.set_instance_action("terminate", iso_utc(time.time() + 3))
            await eventually(lambda: len(events(outbox, "drained")) == 2, "the second drain", 15)
            received = events(outbox, "notice_received")
            assert [r["action"] for r in received] == ["hibernate", "terminate"]
            assert len(bundles(drains)) == 2
            assert [s for s in engine.signals if s[1] == "SIGKILL"] == [
                (engine.job.id, "SIGKILL")
            ] * 2


async def test_an_agent_restarted_after_the_resume_still_hears_the_next_interruption(tmp_path):
    """The agent is restarted after the instance resumed from hibernation (an upgrade, a crash):
    nothing it held in memory survives, but the kernel's count of the time slept does, so the
    next interruption is still a new reclamation, and the bundle of the first stays as it was."""
    slept = ManualClock(0.0)
    machine = one_machine(tmp_path)
    cfg = machine[0]
    with AwsImds() as imds:
        imds.set_instance_action("hibernate", iso_utc(time.time() + 3))
        async with agent_hearing(tmp_path, imds, machine, slept) as (drains, outbox):
            await eventually(lambda: events(outbox, "drained"), "the first drain", timeout=15)
            first = bundles(drains)
        imds.resume()
        slept.advance(6 * 3600.0)
        imds.set_instance_action("terminate", iso_utc(time.time() + 3))
        again = restarted(cfg)
        async with agent_hearing(tmp_path, imds, again, slept) as (drains, outbox):
            await eventually(lambda: len(events(outbox, "drained")) == 2, "the second drain", 15)
            assert len(events(outbox, "notice_received")) == 2
            assert len(bundles(drains)) == 2 and set(first) < set(bundles(drains))
            assert (again[2].job.id, "SIGKILL") in again[2].signals


async def test_a_notice_missing_from_two_reads_is_still_the_one_interruption(tmp_path):
    """Two reads in a row answer 404 while the interruption is pending (a flaky reply, an IMDS
    hiccup), then the notice is back: the same reclamation, never a second one."""
    with AwsImds() as imds:
        t = int(time.time())
        imds.set_instance_action("terminate", iso_utc(t + 300))
        async with agent_hearing(tmp_path, imds) as (drains, outbox):
            await eventually(lambda: events(outbox, "notice_received"), "the notice")
            imds.fail_next(2, 404, path=INSTANCE_ACTION)
            missing = reads(imds, 404)
            await imds.await_seen(
                lambda s: s.path == INSTANCE_ACTION and s.status == 404, count=missing + 2
            )
            back = reads(imds)
            await imds.await_seen(
                lambda s: s.path == INSTANCE_ACTION and s.status == 200, count=back + 2
            )
            # A barrier: an earlier time, handled after whatever the reads above led to.
            imds.set_instance_action("terminate", iso_utc(t + 200))
            await eventually(lambda: events(outbox, "notice_updated"), "the earlier time")
            [updated] = events(outbox, "notice_updated")
            assert (updated["terminate_at"], updated["moved"]) == (t + 200, True)
            assert len(events(outbox, "notice_received")) == 1 and len(bundles(drains)) == 1
