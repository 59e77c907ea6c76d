"""Workload reports on the agent's side: the reclamation machine puts them in the timeline between
the container's SIGTERM and its exit (agent/core/reclamation_reports.py), and the status
directories are watched and read as hostile input (agent/workloads/status_dirs.py). Machine
stories run on a fake clock: T0 = 1000, D = T0 + 30, G = D - 10, O = D - 2."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import stat
import sys

import pytest
from asyncinotify import Inotify, Mask

from spotdrain import workload
from spotdrain.agent.core.notice import Notice
from spotdrain.agent.core.reclamation import Margins, Reclamation
from spotdrain.agent.core.reclamation_commands import SIGKILL, SIGTERM, Emit
from spotdrain.agent.core.reclamation_events import (
    ContainerExited,
    ContainerSignalled,
    Observed,
    RoundListed,
    RoundTarget,
    SignalRoundDone,
    TaintAnswered,
    Tick,
    WorkloadReported,
)
from spotdrain.agent.core.reclamation_reports import PENDING_REPORTS_KEPT
from spotdrain.agent.workloads.status_dirs import (
    IGNORED_INTERVAL_S,
    IGNORED_LINES_PER_INTERVAL,
    INVALID_EVENTS_PER_CONTAINER,
    StatusDirs,
    make_status_dir,
)
from spotdrain.runtime import systemd

T0 = 1000.0
D = T0 + 30
G = D - 10
MARGINS = Margins(
    default_notice_s=30, grace_s=10, overrun_s=2, taint_answer_s=0.8, observe_every_s=0.5
)


def draining() -> Reclamation:
    notice = Notice(
        key="id:i-1", notice_id="i-1", action="terminate", terminate_at=D, source="aws-imds"
    )
    rec, _ = Reclamation.begin(notice, "node-a", T0, MARGINS)
    rec.handle(TaintAnswered(T0 + 0.01))
    return rec


def delivered(rec: Reclamation, sent: ContainerSignalled) -> list:
    """A signal round's delivery: its round listed the container first (write before act)."""
    rec.handle(RoundListed(sent.now, sent.signal, (RoundTarget(sent.container, sent.name),)))
    return rec.handle(sent)


def emitted(commands) -> list[tuple[str, dict, float | None]]:
    return [(c.kind, c.details, c.at) for c in commands if isinstance(c, Emit)]


def started(now, generation=18, name="job"):
    return WorkloadReported(now, name, "checkpoint_started", generation, None, now - 0.001)


def committed(now, generation=18, nbytes=1_400_000_000, name="job"):
    return WorkloadReported(now, name, "checkpoint_committed", generation, nbytes, now - 0.001)


def test_the_final_checkpoint_sits_between_sigterm_and_exit():
    """The published timeline: SIGTERM at T0, the job starts checkpoint 18 at once, commits
    1.4 GB 31 s later, and exits 0. Each report says how long after its SIGTERM it came."""
    rec = draining()
    out = delivered(rec, ContainerSignalled(T0 + 0.02, "c1", "job", SIGTERM, "api"))
    out += rec.handle(started(T0 + 0.05))
    out += rec.handle(committed(T0 + 31.02))
    out += rec.handle(ContainerExited(T0 + 31.5, "c1", "job", 0))
    assert [
        (k, d.get("generation"), d.get("bytes"), d.get("since_sigterm_s"), at)
        for k, d, at in emitted(out)
    ] == [
        ("sigterm_sent", None, None, None, T0 + 0.02),
        ("checkpoint_started", 18, None, 0.03, T0 + 0.05),
        ("checkpoint_committed", 18, 1_400_000_000, 31.0, T0 + 31.02),
        ("container_exited", None, None, None, T0 + 31.5),
    ]
    ck = emitted(out)[2][1]
    assert ck["container"] == "c1" and ck["name"] == "job"
    assert ck["reported_at"] == pytest.approx(T0 + 31.019)


def test_a_report_before_the_sigterm_waits_for_it():
    """The job saw the deadline file (written before the signal round) and started its
    checkpoint before its SIGTERM was recorded: the report is held, then recorded right after
    the sigterm_sent, stamped with that time, and marked as having come first."""
    rec = draining()
    assert rec.handle(started(T0 + 0.015)) == []
    out = delivered(rec, ContainerSignalled(T0 + 0.02, "c1", "job", SIGTERM, "api"))
    assert [(k, at) for k, _, at in emitted(out)] == [
        ("sigterm_sent", T0 + 0.02),
        ("checkpoint_started", T0 + 0.02),
    ]
    details = emitted(out)[1][1]
    assert details["before_sigterm"] is True and details["since_sigterm_s"] == 0.0
    assert rec.pending_reports == {}


def test_a_report_after_the_exit_is_dropped():
    rec = draining()
    delivered(rec, ContainerSignalled(T0 + 0.02, "c1", "job", SIGTERM, "api"))
    rec.handle(ContainerExited(T0 + 2, "c1", "job", 0))
    assert rec.handle(committed(T0 + 2.1)) == []
    assert rec.pending_reports == {}


def test_held_reports_of_a_container_never_signalled_come_out_before_its_exit():
    """A rental (never SIGTERMed) reports a checkpoint and is killed at G: its reports are
    recorded before its exit, with no time since SIGTERM to give."""
    rec = draining()
    rec.handle(started(T0 + 5, name="rental"))
    out = delivered(rec, ContainerSignalled(G, "r1", "rental", SIGKILL, "api"))
    out += rec.handle(ContainerExited(G + 0.2, "r1", "rental", 137))
    kinds = [(k, d.get("since_sigterm_s", "-")) for k, d, _ in emitted(out)]
    assert kinds == [("sigkill_sent", "-"), ("checkpoint_started", None), ("container_exited", "-")]


def test_reports_move_no_deadline_and_prove_nothing():
    """A workload that reports "committed" while it (or a GPU process) is still there gets no
    `drained`: reports are information, never verification (docs/design.md invariant 5)."""
    rec = draining()
    delivered(rec, ContainerSignalled(T0 + 0.02, "c1", "job", SIGTERM, "api"))
    rec.handle(SignalRoundDone(T0 + 0.03, SIGTERM))
    before = (rec.terminate_at, rec.grace_deadline, rec.overrun_at, rec.next_wakeup())
    out = rec.handle(committed(T0 + 1))
    assert [type(c) for c in out] == [Emit]
    assert (rec.terminate_at, rec.grace_deadline, rec.overrun_at, rec.next_wakeup()) == before
    out = rec.handle(Observed(T0 + 1.1, running=("c1",)))
    assert "drained" not in [k for k, _, _ in emitted(out)]
    out = rec.handle(Tick(G))
    assert any(getattr(c, "signal", "") == SIGKILL for c in out)


def test_held_reports_are_bounded_and_survive_a_restart():
    rec = draining()
    for i in range(PENDING_REPORTS_KEPT + 5):
        rec.handle(started(T0 + 0.001 * i, generation=i))
    assert len(rec.pending_reports["job"]) == PENDING_REPORTS_KEPT
    again = Reclamation.from_json(json.loads(json.dumps(rec.to_json())))
    out = delivered(again, ContainerSignalled(T0 + 0.1, "c1", "job", SIGTERM, "api"))
    assert [d["generation"] for k, d, _ in emitted(out) if k == "checkpoint_started"] == list(
        range(PENDING_REPORTS_KEPT)
    )


# --- status directories ------------------------------------------------------------------------


class Seen:
    def __init__(self) -> None:
        self.reports: list[tuple[str, workload.Report]] = []
        self.invalid: list[tuple[str, str, str]] = []
        self.changed = asyncio.Event()

    def report(self, name, report) -> None:
        self.reports.append((name, report))
        self.changed.set()

    def bad(self, name, entry, why) -> None:
        self.invalid.append((name, entry, why))
        self.changed.set()

    async def until(self, predicate, what: str) -> None:
        async with asyncio.timeout(5):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
async def watched(tmp_path):
    seen = Seen()
    dirs = StatusDirs(tmp_path / "status", seen.report, seen.bad)
    ready = asyncio.Event()
    task = asyncio.create_task(dirs.watch(ready))
    await asyncio.wait_for(ready.wait(), 5)
    yield dirs, seen
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_reports_are_read_once_in_order_and_removed(watched):
    """A container's directory made after the watch began is watched too; its reports arrive in
    the order written, each once, and are gone from the directory once read."""
    dirs, seen = watched
    reporter = workload.Reporter(make_status_dir(dirs.root, "job-1"))
    reporter.checkpoint_started(4)
    reporter.checkpoint_committed(4, 123)
    await seen.until(lambda: len(seen.reports) == 2, "two reports")
    assert [(n, r.kind, r.generation, r.nbytes) for n, r in seen.reports] == [
        ("job-1", "checkpoint_started", 4, None),
        ("job-1", "checkpoint_committed", 4, 123),
    ]
    assert os.listdir(dirs.root / "job-1") == []
    assert dirs.collect("job-1") == 0 and len(seen.reports) == 2


async def test_hostile_files_are_refused_unread(watched, tmp_path):
    """Garbage, a link to a host file and a FIFO: each is one invalid report, removed, and the
    agent neither follows the link nor blocks on the FIFO. A good report after them still
    arrives."""
    dirs, seen = watched
    box = make_status_dir(dirs.root, "job-2")
    secret = tmp_path / "secret"
    secret.write_text('{"report": "checkpoint_started", "generation": 1, "at": 1.0}')
    (box / "garbage.json").write_text("{not json")
    os.symlink(secret, box / "link.json")
    os.mkfifo(box / "fifo.json")
    dirs.collect("job-2")  # a FIFO or link fires no CLOSE_WRITE: an exit's collect finds them
    workload.Reporter(box).checkpoint_started(9)
    await seen.until(lambda: len(seen.reports) == 1, "the good report")
    reasons = {entry: why for _, entry, why in seen.invalid}
    assert set(reasons) == {"garbage.json", "link.json", "fifo.json"}
    assert "not JSON" in reasons["garbage.json"]
    assert reasons["link.json"] == "a symbolic link"
    assert reasons["fifo.json"] == "not a regular file"
    assert [(r.kind, r.generation) for _, r in seen.reports] == [("checkpoint_started", 9)]
    assert secret.exists() and os.listdir(box) == []


async def test_a_flood_of_bad_reports_is_reported_a_bounded_number_of_times(watched):
    dirs, seen = watched
    box = make_status_dir(dirs.root, "job-3")
    for i in range(INVALID_EVENTS_PER_CONTAINER + 15):
        (box / f"bad-{i:03d}.json").write_text("[]")
    dirs.collect("job-3")
    assert len(seen.invalid) == INVALID_EVENTS_PER_CONTAINER
    assert os.listdir(box) == []


def test_reports_waiting_at_start_are_read_and_a_reused_name_starts_clean(tmp_path):
    """Reports in a directory before the agent looked are read by the first collect; a new
    container of the same name gets an empty directory (the old one's reports are not its)."""
    seen = Seen()
    dirs = StatusDirs(tmp_path, seen.report, seen.bad)
    box = make_status_dir(tmp_path, "job-4")
    workload.Reporter(box).checkpoint_committed(2, 10)
    dirs.collect_all()
    assert [(n, r.generation) for n, r in seen.reports] == [("job-4", 2)]
    workload.Reporter(box).checkpoint_committed(3, 10)
    make_status_dir(tmp_path, "job-4")
    assert os.listdir(box) == [] and oct(box.stat().st_mode & 0o777) == "0o777"
    with pytest.raises(ValueError, match="not a container name"):
        make_status_dir(tmp_path, "../etc")


async def test_a_planted_device_or_fifo_is_refused_without_being_opened(tmp_path):
    """A job (root in its container) runs mknod for /dev/null's character device, and mkfifo,
    under report names in its status directory. The agent learns their type without opening
    them: inotify on the directory sees the agent open the good report beside them (the watch
    works) and never the device or the FIFO, up to a barrier the test opens after the
    agent's collect. Both are refused as what they are and removed."""
    seen = Seen()
    dirs = StatusDirs(tmp_path / "status", seen.report, seen.bad)
    box = make_status_dir(dirs.root, "job-dev")
    os.mknod(box / "dev.json", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mkfifo(box / "fifo.json")
    workload.Reporter(box).checkpoint_started(7)
    (box / ".barrier").write_text("")
    (report,) = set(os.listdir(box)) - {"dev.json", "fifo.json", ".barrier"}
    with Inotify() as inotify:
        inotify.add_watch(box, Mask.OPEN)
        dirs.collect("job-dev")
        os.close(os.open(box / ".barrier", os.O_RDONLY))
        opened = []
        async with asyncio.timeout(5):
            async for event in inotify:
                if event.name is None:
                    continue  # the directory itself, listed
                if event.name.name == ".barrier":
                    break
                opened.append(event.name.name)
    assert opened == [report]
    assert [(r.kind, r.generation) for _, r in seen.reports] == [("checkpoint_started", 7)]
    assert {(entry, why) for _, entry, why in seen.invalid} == {
        ("dev.json", "not a regular file"),
        ("fifo.json", "not a regular file"),
    }
    assert os.listdir(box) == [".barrier"]


@pytest.fixture
def agent_log(monkeypatch):
    """The agent's own log configuration (systemd.configure_logging, not under systemd: text
    on stderr), its stderr captured."""
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    root = logging.getLogger()
    level = root.level
    handler = systemd.configure_logging("spotdrain-agent", "INFO", node_id="node-a")
    yield stderr
    root.removeHandler(handler)
    root.setLevel(level)


def test_a_flood_of_junk_with_terminal_escapes_logs_a_few_escaped_lines(tmp_path, agent_log):
    """A job writes 2,000 junk files named with an ESC sequence that clears the screen, a BEL
    and a byte that is not UTF-8. Ten are reported as events; the log gets a few lines, each
    showing the name escaped, and once the interval is over one line counts the rest."""
    clock = FakeClockValue()
    seen = Seen()
    dirs = StatusDirs(tmp_path / "status", seen.report, seen.bad, clock=clock)
    box = os.fsencode(make_status_dir(dirs.root, "job-flood"))
    for i in range(2000):
        fd = os.open(box + b"/bad-\x1b[2J\x07-%04d-\xff.json" % i, os.O_WRONLY | os.O_CREAT)
        os.close(fd)
    dirs.collect("job-flood")
    assert len(seen.invalid) == INVALID_EVENTS_PER_CONTAINER and os.listdir(box) == []
    lines = [x for x in agent_log.getvalue().splitlines() if "spotdrain.agent.status" in x]
    assert len(lines) == IGNORED_LINES_PER_INTERVAL
    for line in lines:
        assert "bad-\\x1b[2J\\x07-" in line and "-\\xff.json ignored" in line
        assert line.isprintable()
    clock.now += IGNORED_INTERVAL_S
    dirs.summarise_ignored(clock())
    lines = [x for x in agent_log.getvalue().splitlines() if "spotdrain.agent.status" in x]
    left_out = 2000 - INVALID_EVENTS_PER_CONTAINER - IGNORED_LINES_PER_INTERVAL
    assert len(lines) == IGNORED_LINES_PER_INTERVAL + 1
    assert f"status dir job-flood: {left_out} more files ignored in 60 s" in lines[-1]
    assert all(line.isprintable() for line in agent_log.getvalue().splitlines())


class FakeClockValue:
    def __init__(self, now: float = 5_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
