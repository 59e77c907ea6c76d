"""The agent keeps its promise without its disk (issue 11, item 6): the state directory full,
read-only or failing, a notice is still tainted and signalled on time from memory, each refused
path is recorded once as `state_write_failed`, and nothing is lost once the disk is back.

Unit level, with stores whose writer raises OSError(ENOSPC) and a real SQLite outbox whose file
may not grow (PRAGMA max_page_count: SQLite's own SQLITE_FULL). The real agent on a filled tmpfs
is in tests/e2e/test_full_disk_e2e.py.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fakes.waiting import eventually
from spotdrain.agent.config import AgentConfig
from spotdrain.agent.core.notice import Notice
from spotdrain.agent.core.reclamation import Margins, Reclamation
from spotdrain.agent.core.reclamation_events import ContainerExited, ContainerSignalled
from spotdrain.agent.drain.deadline_file import DeadlineFile
from spotdrain.agent.drain.outbox import DROPPED_KIND, Outbox
from spotdrain.agent.drain.runner import DrainRunner
from spotdrain.agent.drain.state import (
    BundleStore,
    LocalTaints,
    WriteHealth,
    write_deadline_file,
    write_json,
)
from spotdrain.agent.workloads.docker_engine import ContainerInfo

NODE = "node-full"


class Disk:
    """A writer for the stores: works, or refuses every write with the errno given."""

    def __init__(self) -> None:
        self.refuse: int | None = None
        self.writes: list[Path] = []
        self.refused = 0  # writes refused so far: a retry tick's trace a test can wait for

    def __call__(self, path: Path, doc: Any, mode: int) -> None:
        if self.refuse is not None:
            self.refused += 1
            raise OSError(self.refuse, os.strerror(self.refuse), str(path))
        write_json(path, doc, mode)
        self.writes.append(path)


def reports() -> tuple[WriteHealth, list[tuple[str, dict[str, Any]]]]:
    said: list[tuple[str, dict[str, Any]]] = []
    return WriteHealth(lambda kind, details: said.append((kind, details))), said


def rec(key: str = "n-1", now: float = 1000.0) -> Reclamation:
    notice = Notice(
        key=key, notice_id=key, action="terminate", terminate_at=now + 30, source="aws-imds"
    )
    return Reclamation.begin(notice, NODE, now, Margins())[0]


# --- the stores ---------------------------------------------------------------------------------


def test_a_bundle_the_disk_refuses_is_kept_in_memory_reported_once_and_written_when_it_can(
    tmp_path: Path,
) -> None:
    """The disk fills up mid-drain: every save of the bundle fails with ENOSPC. The store still
    knows the reclamation (a repeat notice is still a duplicate, a restart of the loop still
    finds it), says so once, and writes it as soon as the disk takes it."""
    disk, (health, said) = Disk(), reports()
    store = BundleStore(tmp_path, health, write=disk)
    r = rec()
    disk.refuse = errno.ENOSPC
    assert store.save(r) is False
    r.phase = "draining"
    assert store.save(r) is False and store.save(r) is False
    path = str(tmp_path / "reclamations" / f"{r.reclaim_id}.json")
    assert said == [
        ("state_write_failed", {"path": path, "errno": "ENOSPC", "error": said[0][1]["error"]})
    ]
    assert store.exists(r.reclaim_id) and not Path(path).exists()
    assert [b.phase for b in store.load_all()] == ["draining"]

    disk.refuse = None
    assert store.retry() is True
    assert json.loads(Path(path).read_text())["phase"] == "draining"
    assert said[1:] == [("state_write_resumed", {"path": path})]
    assert store.unsaved == {}


def test_a_local_taint_the_disk_refuses_still_refuses_every_start(tmp_path: Path) -> None:
    """The coordinator is silent and the disk read-only: the local taint is in force in memory
    (invariant 4) and reaches the file once the disk takes it."""
    disk, (health, said) = Disk(), reports()
    taints = LocalTaints(tmp_path, health, write=disk)
    disk.refuse = errno.EROFS
    taints.apply("rcl-1")
    assert taints.refuse_start() == "node is locally tainted for rcl-1"
    assert [(k, d["errno"]) for k, d in said] == [("state_write_failed", "EROFS")]
    assert taints.retry() is False and len(said) == 1
    disk.refuse = None
    assert taints.retry() is True
    assert json.loads((tmp_path / "local_taints.json").read_text()) == ["rcl-1"]
    assert LocalTaints(tmp_path).refuse_start() is not None  # what a restarted agent reads


def test_a_write_the_disk_takes_only_in_part_is_finished_or_never_renamed_into_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A nearly full disk takes a few bytes of a write without an error, then refuses the rest.
    The bundle on disk is the old one, whole (never a short file a restart could not read), and
    the temp file is gone, so its space is free for the next try."""
    path = tmp_path / "b.json"
    write_json(path, {"old": True})
    real_write = os.write
    calls = {"n": 0}

    def short_then_full(fd: int, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, bytes(data[:5]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", short_then_full)
    with pytest.raises(OSError):
        write_json(path, {"new": "x" * 100})
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
    write_json(tmp_path / "c.json", {"whole": "y" * 50})  # short writes, no error: finished
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"old": True}
    assert json.loads((tmp_path / "c.json").read_text()) == {"whole": "y" * 50}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json", "c.json"]


# --- the outbox ---------------------------------------------------------------------------------


def frozen_size(outbox: Outbox, frozen: bool) -> None:
    """SQLite may not grow the file (max_page_count at its size): inserts fail SQLITE_FULL."""
    assert outbox.db is not None
    pages = outbox.db.execute("PRAGMA page_count").fetchone()[0]
    outbox.db.execute(f"PRAGMA max_page_count = {pages if frozen else 1 << 30}")


def read_only(outbox: Outbox, refuse: bool) -> None:
    """The outbox's file taken read-only (or given back): every write fails SQLITE_READONLY."""
    assert outbox.db is not None
    outbox.db.close()
    mode = "ro" if refuse else "rw"
    outbox.db = sqlite3.connect(f"file:{outbox.path}?mode={mode}", uri=True, isolation_level=None)


def put(outbox: Outbox, kind: str, n: int = 0) -> str:
    # Details larger than a page: every event needs new pages.
    return outbox.put(
        outbox.event(kind, NODE, "rcl-1", time.time(), 0.1, {"n": n, "pad": "p" * 5000})
    ).uid


def stored(outbox: Outbox) -> list[str]:
    assert outbox.db is not None
    return [
        json.loads(b)["kind"] for (b,) in outbox.db.execute("SELECT body FROM outbox ORDER BY seq")
    ]


def test_events_the_outbox_cannot_store_wait_in_memory_are_sent_and_stored_in_order_later(
    tmp_path: Path,
) -> None:
    """The SQLite file cannot grow. Events keep coming: each is held in memory, handed to the
    link after the stored ones (so the coordinator still hears of them), and the failure is
    recorded once, as ENOSPC, naming the file. When SQLite can grow again, the next event first
    moves the held ones in, in order; acknowledgements empty both."""
    health, said = reports()
    outbox = Outbox(tmp_path / "outbox.sqlite", health)
    put(outbox, "notice_received")
    frozen_size(outbox, True)
    for kind in ("tainted", "sigterm_sent", "container_exited"):
        put(outbox, kind)
    assert [e.kind for e in outbox.pending()] == [
        "notice_received",
        "tainted",
        "sigterm_sent",
        "container_exited",
    ]
    assert [(k, d["path"], d["errno"]) for k, d in said] == [
        ("state_write_failed", str(tmp_path / "outbox.sqlite"), "ENOSPC")
    ]
    assert stored(outbox) == ["notice_received"] and outbox.held_in_memory == 3
    assert len(outbox) == 4

    frozen_size(outbox, False)
    put(outbox, "drained")
    assert stored(outbox) == [
        "notice_received",
        "tainted",
        "sigterm_sent",
        "container_exited",
        "drained",
    ]
    assert outbox.held_in_memory == 0
    assert [k for k, _ in said] == ["state_write_failed", "state_write_resumed"]
    outbox.acknowledge([e.uid for e in outbox.pending()])
    assert len(outbox) == 0
    outbox.close()


def test_acknowledged_events_the_disk_will_not_delete_are_never_sent_again(tmp_path: Path) -> None:
    """The coordinator acknowledges events while SQLite cannot even delete them (its journal
    cannot grow). They are not handed out again, and are deleted once it can."""
    outbox = Outbox(tmp_path / "outbox.sqlite")
    uids = [put(outbox, "sigterm_sent", i) for i in range(3)]
    outbox.db.close()  # type: ignore[union-attr]
    outbox.db = sqlite3.connect(
        f"file:{tmp_path / 'outbox.sqlite'}?mode=ro", uri=True, isolation_level=None
    )
    outbox.acknowledge(uids[:2])
    assert [e.uid for e in outbox.pending()] == uids[2:]
    assert len(outbox) == 1
    outbox.db.close()
    outbox.db = None
    outbox._open()
    assert outbox.retry() is True  # nothing left waiting for the disk
    assert [e.uid for e in outbox.pending()] == uids[2:]
    assert outbox.db.execute("SELECT count(*) FROM outbox").fetchone()[0] == 1  # the two gone


def test_an_outbox_that_cannot_even_be_opened_holds_events_in_memory_and_opens_later(
    tmp_path: Path,
) -> None:
    """The agent starts on a read-only or full state directory: the outbox is memory only,
    the failure waits for the drain runner to record it, and the file is made once it can be."""
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o500)
    health, said = WriteHealth(), []
    try:
        outbox = Outbox(
            state / "outbox.sqlite",
            health,
            connect=lambda p: sqlite3.connect(f"file:{p}?mode=rw", uri=True, isolation_level=None),
        )
        assert outbox.db is None
        uid = put(outbox, "notice_received")
        assert [e.uid for e in outbox.pending()] == [uid]
        health.attach(lambda kind, details: said.append((kind, details)))
        assert [(k, d["errno"]) for k, d in said] == [("state_write_failed", "EACCES")]
    finally:
        state.chmod(0o700)
    outbox._connect = lambda p: sqlite3.connect(p, isolation_level=None)
    assert outbox.retry() is True
    assert stored(outbox) == ["notice_received"]


def test_past_the_memory_bound_the_oldest_events_are_dropped_and_counted(tmp_path: Path) -> None:
    """The disk and the coordinator are away for long: held events are bounded. Beyond the
    bound the oldest go, and one events_dropped, first in line, says how many and of what."""
    outbox = Outbox(tmp_path / "outbox.sqlite", memory_kept=4)
    frozen_size(outbox, True)
    for i in range(7):
        put(outbox, "container_exited" if i < 2 else "sigterm_sent", i)
    pending = outbox.pending()
    assert pending[0].kind == DROPPED_KIND
    assert pending[0].details == {"count": 3, "kinds": {"container_exited": 2, "sigterm_sent": 1}}
    assert [e.details["n"] for e in pending[1:]] == [3, 4, 5, 6]
    assert len(outbox) == 5


# --- the drain runner on a disk that refuses everything -----------------------------------------


class Link:
    def __init__(self) -> None:
        self.taints: list[str] = []

    async def taint(self, reclaim_id: str, reason: str, timeout: float, **_: Any) -> None:
        self.taints.append(reclaim_id)

    async def taint_until_answered(self, reclaim_id: str, reason: str, **_: Any) -> None:
        self.taints.append(reclaim_id)

    async def resume_until_answered(self, reclaim_id: str) -> None:
        pass

    def wake(self) -> None:
        pass

    def hold_events(self, key: str) -> None:
        pass

    def release_events(self, key: str) -> None:
        pass


class Engine:
    """One batch job that exits 0 on SIGTERM."""

    def __init__(self) -> None:
        self.job = ContainerInfo("c1" * 32, "job-1", "batch", 0, image="trainer:1")
        self.running_now = [self.job]
        self.signals: list[tuple[str, str]] = []
        self.gone = asyncio.Event()

    async def targets(self, skip: frozenset[str], skip_kinds: frozenset[str]) -> list:
        return [t for t in self.running_now if t.id not in skip and t.kind not in skip_kinds]

    async def signal_each(self, targets: list, signal: str) -> AsyncIterator[ContainerSignalled]:
        for t in targets:
            self.signals.append((t.id, signal))
            self.running_now = []
            self.gone.set()
            yield ContainerSignalled(
                time.time(), t.id, t.name, signal, "api", image=t.image, kind=t.kind
            )

    async def wait_exit(self, container_id: str, name: str) -> ContainerExited:
        await self.gone.wait()
        return ContainerExited(time.time(), container_id, name, 0)

    async def running(self) -> list:
        return list(self.running_now)


class Gpus:
    async def processes(self) -> list:
        return []


class Workers:
    workers: dict = {}

    def drain(self, worker_id: Any, grace_deadline: float, reclaim_id: str) -> list[str]:
        return []

    def cut_all(self) -> None:
        pass


async def test_a_notice_on_a_disk_that_refuses_every_write_is_answered_on_time(
    tmp_path: Path,
) -> None:
    """Every write to the state directory and the deadline file fails with ENOSPC, and the
    outbox's SQLite refuses every write (the file went read-only). A notice still taints,
    SIGTERMs the job and verifies the node empty from memory; each refused path is recorded
    once however often it is retried; the loop never stops. Once the disk is back, the bundle,
    the deadline file and the held events are written, in order."""
    disk = Disk()
    disk.refuse = errno.ENOSPC
    deadline_refused = {"on": True, "times": 0}

    def deadline_file(path: Path, *args: Any) -> None:
        if deadline_refused["on"]:
            deadline_refused["times"] += 1
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write_deadline_file(path, *args)

    cfg = AgentConfig(
        coordinator="127.0.0.1:1",
        node_id=NODE,
        notice_file=tmp_path / "n.json",
        state_dir=tmp_path / "state",
        insecure=True,
        deadline_file=tmp_path / "workload" / "deadline.json",
        status_dir=tmp_path / "status",
        socket=tmp_path / "agent.sock",
        margins=Margins(grace_s=3, overrun_s=1, observe_every_s=0.05),
    )
    health = WriteHealth()
    cfg.state_dir.mkdir()
    outbox = Outbox(cfg.state_dir / "outbox.sqlite", health)
    read_only(outbox, True)
    engine, link = Engine(), Link()
    drains = DrainRunner(
        cfg,
        outbox,
        link,
        engine,
        Gpus(),
        Workers(),
        health=health,  # type: ignore[arg-type]
        bundles=BundleStore(cfg.state_dir, health, write=disk),
        local_taints=LocalTaints(cfg.state_dir, health, write=disk),
        deadline_file=DeadlineFile(cfg.deadline_file, health, write=deadline_file),
        retry_writes_s=0.05,
    )
    loop = asyncio.create_task(drains.run())
    try:
        t0 = time.time()
        drains.notice(
            Notice(
                key="full-1",
                notice_id="full-1",
                action="terminate",
                terminate_at=t0 + 20,
                source="aws-imds",
            )
        )
        outcome = await asyncio.wait_for(drains.settled("full-1"), 5)
        assert outcome == "drained"
        assert link.taints and engine.signals == [(engine.job.id, "SIGTERM")]
        # Several retry ticks of both refused paths (a barrier, not a sleep): still one report
        # per path.
        tried = (disk.refused, deadline_refused["times"])
        await eventually(
            lambda: disk.refused >= tried[0] + 3 and deadline_refused["times"] >= tried[1] + 3,
            "three more refused tries of the bundle and of the deadline file",
        )
        assert not loop.done()
        kinds = [e.kind for e in outbox.pending()]
        for kind in (
            "notice_received",
            "tainted",
            "sigterm_sent",
            "container_exited",
            "verified_empty",
            "drained",
        ):
            assert kinds.count(kind) == 1, (kind, kinds)
        failed = [e.details for e in outbox.pending() if e.kind == "state_write_failed"]
        rid = drains.recent[next(iter(drains.recent))].reclaim_id
        assert sorted((d["path"], d["errno"]) for d in failed) == sorted(
            [
                (str(cfg.state_dir / "reclamations" / f"{rid}.json"), "ENOSPC"),
                (str(cfg.deadline_file), "ENOSPC"),
                (str(cfg.state_dir / "outbox.sqlite"), "EROFS"),
            ]
        )
        written = next(e for e in outbox.pending() if e.kind == "deadline_file_written")
        assert written.details["written"] is False
        assert stored(outbox) == []

        disk.refuse = None
        deadline_refused["on"] = False
        read_only(outbox, False)
        bundle = cfg.state_dir / "reclamations" / f"{rid}.json"
        for _ in range(100):
            if bundle.exists() and outbox.held_in_memory == 0:
                break
            await asyncio.sleep(0.05)
        assert json.loads(bundle.read_text())["outcome"] == "drained"
        assert json.loads(cfg.deadline_file.read_text())["reclaim_id"] == rid
        assert stored(outbox) == kinds + ["state_write_resumed"] * 3
        assert not loop.done()
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await drains.close()
        outbox.close()
