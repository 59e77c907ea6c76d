"""spotdrain.workload, the module workloads use (proto/spotdrain/workload.py): the deadline file,
the time left, SIGTERM once, and checkpoint reports into the status directory."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fakes.waiting import wait_until
from spotdrain import workload
from spotdrain.agent.drain.state import write_deadline_file
from spotdrain.workload import Deadline, DeadlineInvalid, Reclaim, ReportInvalid, parse_report

MODULE = Path(workload.__file__)


def deadline_doc(**override) -> dict:
    doc = Deadline("rcl-1", 2000.0, 1990.0, "notice").to_json()
    doc.update(override)
    return doc


class Calls:
    def __init__(self) -> None:
        self.seen: list[tuple[str, Deadline | None]] = []
        self.reclaim: Reclaim | None = None

    def __call__(self, deadline: Deadline | None) -> None:
        assert self.reclaim is not None
        self.seen.append((self.reclaim.trigger, deadline))


@pytest.fixture
def reclaim(tmp_path):
    calls = Calls()
    r = Reclaim(calls, deadline_file=tmp_path / "workload" / "deadline.json", poll_s=0.02)
    calls.reclaim = r
    (tmp_path / "workload").mkdir()
    r.start()
    yield r, calls
    r.close()


def test_sigterm_then_deadline_file_runs_the_callback_once(reclaim):
    """The engine's SIGTERM lands before the agent's deadline file (a `docker kill` by hand, or
    a signal round that raced the file): the callback runs at the signal, with no deadline yet;
    the file appearing afterwards, and a second SIGTERM, run nothing more."""
    r, calls = reclaim
    os.kill(os.getpid(), signal.SIGTERM)
    assert r.wait(5)
    assert calls.seen == [("sigterm", None)]
    write_deadline_file(r.path, "rcl-1", 2000.0, 1990.0, "notice")
    os.kill(os.getpid(), signal.SIGTERM)
    wait_until(lambda: len(r.stimuli) == 3, 5, "the file and the second SIGTERM to be seen")
    assert sorted(what for what, _ in r.stimuli) == ["deadline_file", "sigterm", "sigterm"]
    assert r.stimuli[0][0] == "sigterm"
    assert calls.seen == [("sigterm", None)]
    assert r.error is None


def test_deadline_file_then_sigterm_runs_the_callback_once(reclaim):
    """The agent's order (docs/design.md step 4): the deadline file, then SIGTERM. The callback
    runs when the file appears, with its deadlines; the SIGTERM after it changes nothing."""
    r, calls = reclaim
    write_deadline_file(r.path, "rcl-7", 2000.0, 1990.0, "pause")
    assert r.wait(5)
    os.kill(os.getpid(), signal.SIGTERM)
    wait_until(lambda: len(r.stimuli) == 2, 5, "the SIGTERM to be seen")
    assert [what for what, _ in r.stimuli] == ["deadline_file", "sigterm"]
    assert calls.seen == [("deadline_file", Deadline("rcl-7", 2000.0, 1990.0, "pause"))]


def test_sigterm_with_the_file_already_there_hands_over_its_deadline(tmp_path):
    path = tmp_path / "deadline.json"
    write_deadline_file(path, "rcl-2", 2000.0, 1990.0, "notice")
    got: list = []
    # A poll far longer than the test: only the SIGTERM can wake the thread in time.
    r = Reclaim(got.append, deadline_file=path, poll_s=3600)
    r.start()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert r.wait(5)
        assert r.trigger == "sigterm" and got == [Deadline("rcl-2", 2000.0, 1990.0, "notice")]
    finally:
        r.close()


def test_a_malformed_deadline_file_is_no_trigger(reclaim):
    """Half a file (or garbage) in the deadline file's place is not a reclamation: no call. The
    valid file that replaces it is."""
    r, calls = reclaim
    r.path.write_text('{"reclaim_id": "rcl-1", "terminate_at_epoch": NaN}')
    assert r.time_left() is None
    looked = r.looks
    wait_until(lambda: r.looks >= looked + 2, 5, "the watcher to read the bad file")
    assert not r.fired.is_set() and r.stimuli == []
    write_deadline_file(r.path, "rcl-1", 2000.0, 1990.0, "notice")
    assert r.wait(5)
    assert calls.seen == [("deadline_file", Deadline("rcl-1", 2000.0, 1990.0, "notice"))]


def test_callback_errors_are_kept_not_lost(tmp_path):
    def boom(deadline):
        raise RuntimeError("checkpoint failed")

    r = Reclaim(boom, deadline_file=tmp_path / "d.json", poll_s=0.02).start()
    try:
        write_deadline_file(tmp_path / "d.json", "rcl-1", 2000.0, 1990.0, "notice")
        assert r.wait(5)
        assert isinstance(r.error, RuntimeError) and r.trigger == "deadline_file"
    finally:
        r.close()


def test_start_outside_the_main_thread_is_refused(tmp_path):
    errors: list = []

    def run() -> None:
        try:
            Reclaim(lambda d: None, deadline_file=tmp_path / "d.json").start()
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert errors and "main thread" in errors[0]


# --- time left ---------------------------------------------------------------------------------


def test_time_left_follows_the_clock(tmp_path):
    """Time left is to G (the SIGKILL), not to D, by the clock given."""
    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    path = tmp_path / "deadline.json"
    write_deadline_file(path, "rcl-1", 1120.0, 1110.0, "notice")
    d = workload.read_deadline(path)
    assert d is not None and d.reclaim_at == 1110.0
    assert d.time_left(clock) == 110.0
    now[0] = 1109.5
    assert d.time_left(clock) == pytest.approx(0.5)
    now[0] = 1111.0
    assert d.time_left(clock) == pytest.approx(-1.0)
    r = Reclaim(lambda d: None, deadline_file=path, clock=clock)
    assert r.time_left() == pytest.approx(-1.0)
    path.unlink()
    assert r.time_left() is None and workload.read_deadline(path) is None


def test_read_deadline_uses_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "d.json"
    write_deadline_file(path, "rcl-env", 2000.0, 1990.0, "notice")
    monkeypatch.setenv(workload.DEADLINE_FILE_ENV, str(path))
    assert workload.read_deadline() == Deadline("rcl-env", 2000.0, 1990.0, "notice")
    monkeypatch.delenv(workload.DEADLINE_FILE_ENV)
    # Without the variable (a Slurm job step, started by slurmd, not by the agent): the agent's
    # default path on the host, here pointed at the test's directory.
    host_file = tmp_path / "run" / "deadline.json"
    monkeypatch.setattr(workload, "DEFAULT_DEADLINE_FILE", host_file)
    assert workload.read_deadline() is None  # no reclamation under way: no file
    write_deadline_file(host_file, "rcl-host", 2100.0, 2090.0, "pause")
    assert workload.read_deadline() == Deadline("rcl-host", 2100.0, 2090.0, "pause")


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ({"terminate_at_epoch": math.nan}, "NaN is not a number"),
        ({"grace_deadline_epoch": math.inf}, "Infinity is not a number"),
        ({"grace_deadline_epoch": 1e300}, "finite"),
        ({"grace_deadline_epoch": True}, "number"),
        ({"grace_deadline_epoch": "1990"}, "number"),
        ({"grace_deadline_epoch": 2001.0}, "after terminate_at"),
        ({"reason": "maintenance"}, "reason"),
        ({"reclaim_id": ""}, "reclaim_id"),
        ({"reclaim_id": "x" * 201}, "reclaim_id"),
        ({"terminate_at_epoch": -5.0}, "finite"),
    ],
)
def test_malformed_deadlines_are_refused_with_the_reason(tmp_path, override, why):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(deadline_doc(**override)))
    with pytest.raises(DeadlineInvalid, match=why):
        workload.read_deadline(path)


def test_deadline_file_edge_cases(tmp_path):
    path = tmp_path / "d.json"
    for raw, why in [
        (b"[1]", "JSON object"),
        (b"{", "not JSON"),
        (b'{"a": "' + b"x" * 5000 + b'"}', "larger"),
    ]:
        path.write_bytes(raw)
        with pytest.raises(DeadlineInvalid, match=why):
            workload.read_deadline(path)


def test_the_agent_never_writes_a_deadline_the_module_would_refuse(tmp_path):
    """One definition: what the agent writes is what the module reads, and a bad deadline is
    refused before anything is written (the file in place stays as it was)."""
    path = tmp_path / "d.json"
    write_deadline_file(path, "rcl-1", 2000.5, 1990.25, "notice")
    before = path.read_bytes()
    doc = json.loads(before)
    assert doc == {
        "reclaim_id": "rcl-1",
        "reason": "notice",
        "terminate_at": "1970-01-01T00:33:20.500000Z",
        "terminate_at_epoch": 2000.5,
        "grace_deadline": "1970-01-01T00:33:10.250000Z",
        "grace_deadline_epoch": 1990.25,
        "reclaim_at": "1970-01-01T00:33:10.250000Z",
        "reclaim_at_epoch": 1990.25,
    }
    with pytest.raises(DeadlineInvalid):
        write_deadline_file(path, "rcl-1", math.nan, 1990.0, "notice")
    assert path.read_bytes() == before


# --- reports -----------------------------------------------------------------------------------


def test_reports_land_whole_and_in_order(tmp_path):
    """A reader listing the status directory while reports are written (what the agent does)
    only ever finds whole reports, never a temporary file under a report's name, and the names
    sort in the order the reports were made, even within one clock tick."""
    status = tmp_path / "status"
    status.mkdir()
    frozen = lambda: 1234.5  # noqa: E731  (every report in the same instant)
    reporter = workload.Reporter(status, clock=frozen)
    stop = threading.Event()
    bad: list[str] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            for p in status.iterdir():
                if p.name.startswith("."):
                    continue  # a temporary file, not yet a report
                try:
                    parse_report(p.read_bytes())
                    reads[0] += 1
                except FileNotFoundError:
                    pass
                except ReportInvalid as e:
                    bad.append(f"{p.name}: {e}")

    t = threading.Thread(target=reader)
    t.start()
    try:
        for g in range(200):
            reporter.checkpoint_started(g)
            reporter.checkpoint_committed(g, g * 1000)
    finally:
        stop.set()
        t.join()
    assert bad == [] and reads[0] > 0
    names = sorted(p.name for p in status.iterdir())
    assert not [n for n in names if n.startswith(".")]
    got = [parse_report((status / n).read_bytes()) for n in names]
    want = [(k, g) for g in range(200) for k in workload.REPORT_KINDS]
    assert [(r.kind, r.generation) for r in got] == want
    assert got[1] == workload.Report("checkpoint_committed", 0, 1234.5, 0)


def test_a_reader_that_takes_reports_at_once_never_breaks_the_writer(tmp_path):
    """The agent removes each report the moment it has read it, which may be right after the
    rename: the writer has nothing left to do to the file by then (a chmod after the rename
    once failed a job with FileNotFoundError)."""
    reporter = workload.Reporter(tmp_path)
    stop = threading.Event()
    taken: list[int] = []

    def agent() -> None:
        while not stop.is_set() or any(not n.startswith(".") for n in os.listdir(tmp_path)):
            for name in sorted(os.listdir(tmp_path)):
                if not name.startswith("."):
                    taken.append(parse_report((tmp_path / name).read_bytes()).generation)
                    os.unlink(tmp_path / name)

    t = threading.Thread(target=agent)
    t.start()
    try:
        for g in range(300):
            reporter.checkpoint_started(g)
    finally:
        stop.set()
        t.join()
    assert taken == list(range(300))


def test_a_report_cut_short_leaves_nothing_behind(tmp_path, monkeypatch):
    """The disk fails between write and rename (here fsync fails): no report, and no temporary
    file either (on a full disk its space is what the next try needs)."""
    reporter = workload.Reporter(tmp_path)

    def fail(fd):
        raise OSError(5, "I/O error")

    monkeypatch.setattr(workload.os, "fsync", fail)
    with pytest.raises(OSError):
        reporter.checkpoint_started(3)
    assert list(tmp_path.iterdir()) == []


# --- the one atomic write (the agent's state files go through it too) --------------------------


def test_a_failed_write_keeps_the_old_content_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """The rename itself is refused (EXDEV, EACCES...): the old file is intact, and nothing
    else is left in the directory."""
    path = tmp_path / "b.json"
    workload.write_atomic(path, b"old")

    def refuse(src, dst):
        raise OSError(13, "Permission denied")

    monkeypatch.setattr(workload.os, "replace", refuse)
    with pytest.raises(OSError):
        workload.write_atomic(path, b"new")
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"]


def test_the_file_has_its_mode_before_it_has_its_name(tmp_path, monkeypatch):
    """A reader may take the file the moment it appears: under a strict umask it must already
    carry the mode asked for (the agent's copy set it after the rename)."""
    seen = []
    real_replace = os.replace

    def replace(src, dst):
        seen.append(stat.S_IMODE(os.stat(src).st_mode))
        real_replace(src, dst)

    monkeypatch.setattr(workload.os, "replace", replace)
    old_umask = os.umask(0o077)
    try:
        workload.write_atomic(tmp_path / "deadline.json", b"{}", mode=0o644)
        workload.write_atomic(tmp_path / "book.json", b"{}", mode=0o600)
    finally:
        os.umask(old_umask)
    assert seen == [0o644, 0o600]
    assert stat.S_IMODE((tmp_path / "deadline.json").stat().st_mode) == 0o644


def test_durable_syncs_the_file_then_its_directory_and_fast_syncs_nothing(tmp_path, monkeypatch):
    """A durable write survives a power loss only if the rename (a directory entry) reached
    the disk too; the deadline file (in /run, rewritten at start) skips both."""
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(workload.os, "fsync", fsync)
    workload.write_atomic(tmp_path / "bundle.json", b"{}")
    assert synced == ["file", "dir"]
    synced.clear()
    workload.write_atomic(tmp_path / "deadline.json", b"{}", durable=False)
    assert synced == []


def test_two_writers_of_one_file_never_share_a_temporary_file(tmp_path):
    """Two threads rewriting one file: every write lands whole (a shared temporary name
    would let one truncate the other's file, or rename it away under it)."""
    path = tmp_path / "shared.json"
    errors = []

    def writer(fill: bytes) -> None:
        try:
            for n in range(200):
                workload.write_atomic(path, fill * (n + 1), durable=False)
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(c,)) for c in (b"a", b"b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    data = path.read_bytes()
    assert len(set(data)) == 1 and len(data) <= 200
    assert [p.name for p in tmp_path.iterdir()] == ["shared.json"]


@pytest.mark.parametrize(
    ("call", "why"),
    [
        (lambda r: r.checkpoint_started(-1), "between"),
        (lambda r: r.checkpoint_started(True), "integer"),
        (lambda r: r.checkpoint_started(2**60), "between"),
        (lambda r: r.checkpoint_committed(1, -3), "between"),
        (lambda r: r.checkpoint_committed(1, 1.5), "integer"),
    ],
)
def test_bad_reports_are_refused_before_anything_is_written(tmp_path, call, why):
    reporter = workload.Reporter(tmp_path)
    with pytest.raises(ReportInvalid, match=why):
        call(reporter)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"{", "not JSON"),
        (b"[]", "not a JSON object"),
        (b'{"report": "checkpoint_done", "generation": 1, "at": 1.0}', "report must be"),
        (b'{"report": "checkpoint_started", "generation": 1, "at": NaN}', "not JSON"),
        (b'{"report": "checkpoint_started", "generation": 1, "at": 1e400}', "finite"),
        (b'{"report": "checkpoint_committed", "generation": 1, "at": 1.0}', "bytes"),
        (b'{"report": "checkpoint_started", "generation": 1, "at": 1.0, "bytes": 2}', "no bytes"),
        (b'{"report": "checkpoint_started", "generation": "1", "at": 1.0}', "integer"),
        (b" " * 5000, "larger"),
    ],
)
def test_malformed_reports_say_what_is_wrong(raw, why):
    with pytest.raises(ReportInvalid, match=why):
        parse_report(raw)


def test_no_status_dir_means_reports_are_skipped(monkeypatch):
    monkeypatch.delenv(workload.STATUS_DIR_ENV, raising=False)
    assert workload.Reporter().checkpoint_committed(1, 10) is None


# --- the one file on a bare python3 ------------------------------------------------------------

BARE_JOB = textwrap.dedent("""
    import os, sys, time
    import workload  # the one file, copied beside this script

    # Standard library only: every module loaded is one of Python's own.
    foreign = sorted(m.split(".")[0] for m in sys.modules
                     if m.split(".")[0] not in sys.stdlib_module_names
                     and m.split(".")[0] not in ("workload", "__main__"))
    assert not foreign, foreign

    def final_checkpoint(deadline):
        workload.checkpoint_started(7)
        left = None if deadline is None else round(deadline.time_left(lambda: 1000.0), 3)
        workload.checkpoint_committed(7, 4096)
        print(f"checkpointed on {r.trigger}, {left} s left", flush=True)

    r = workload.on_reclaim(final_checkpoint, poll_s=0.05)
    print("ready", flush=True)
    r.wait()
    # Alive, the handler in place, until told: the test's second stimulus must meet the job,
    # not the interpreter's shutdown (which puts the default SIGTERM action back).
    sys.stdin.readline()
    sys.exit(0)
""")


@pytest.mark.parametrize("first", ["sigterm", "deadline_file"])
def test_the_one_file_on_a_bare_python3(tmp_path, first):
    """Only workload.py copied into an empty directory, the system's /usr/bin/python3 in
    -E -S (no PYTHONPATH, no site-packages: the script's directory and the standard library): the
    SIGTERM or the deadline file runs the final checkpoint once, and the reports arrive."""
    python = shutil.which("python3", path="/usr/bin") or sys.executable
    job_dir = tmp_path / "image"
    job_dir.mkdir()
    shutil.copy(MODULE, job_dir / "workload.py")
    (job_dir / "job.py").write_text(BARE_JOB)
    status, deadline = tmp_path / "status", tmp_path / "run" / "deadline.json"
    status.mkdir()
    deadline.parent.mkdir()
    env = {
        "SPOTDRAIN_STATUS_DIR": str(status),
        "SPOTDRAIN_DEADLINE_FILE": str(deadline),
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.Popen(
        [python, "-E", "-S", str(job_dir / "job.py")],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        if first == "sigterm":
            proc.send_signal(signal.SIGTERM)
            checkpointed = proc.stdout.readline()
            write_deadline_file(deadline, "rcl-9", 1120.0, 1110.0, "notice")
        else:
            write_deadline_file(deadline, "rcl-9", 1120.0, 1110.0, "notice")
            checkpointed = proc.stdout.readline()
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate("\n", timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    left = "None" if first == "sigterm" else "110.0"
    assert checkpointed + out == f"checkpointed on {first}, {left} s left\n"
    reports = [parse_report(p.read_bytes()) for p in sorted(status.iterdir())]
    assert [(r.kind, r.generation, r.nbytes) for r in reports] == [
        ("checkpoint_started", 7, None),
        ("checkpoint_committed", 7, 4096),
    ]
    assert all(abs(r.at - time.time()) < 60 for r in reports)
