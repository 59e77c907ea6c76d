"""spotdrain.workload: the workload's side of a reclamation, standard library only.

A workload imports it from the `spotdrain` package, or copies this one file into its image and
imports it as `workload` (it imports nothing outside the standard library, so a bare `python3`
runs it). What it gives (docs/workloads.md, "The workload SDK"):

- `read_deadline()`: the deadline file the agent writes ($SPOTDRAIN_DEADLINE_FILE, else its
  default path on the host, /run/spotdrain/workload/deadline.json), parsed and
  checked, or None while there is none; `Deadline.time_left()` to the grace deadline G, after
  which whatever still runs is SIGKILLed.
- `on_reclaim(callback)`: the callback runs once, in a thread of its own, on the first SIGTERM
  or the first sight of the deadline file, whichever comes first; never twice (a second SIGTERM
  or a rewritten deadline file changes nothing).
- `checkpoint_started(generation)` and `checkpoint_committed(generation, bytes)`: reports
  written atomically (temporary file, fsync, rename, fsync of the directory) into
  $SPOTDRAIN_STATUS_DIR, which the agent watches and records in the reclamation's timeline.
  Reports are information: they never move a deadline or count as the node being empty.

The deadline file's format and the reports' format are defined here once (`Deadline`,
`report_document`, `parse_report`); the agent writes and reads them through this module.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# --- the names a workload meets ----------------------------------------------------------------

# Labels on every workload container (docs/design.md "Four drain paths"): the agent touches only
# containers with its own node label; the kind chooses how the container is drained.
NODE_LABEL = "spotdrain.node"
KIND_LABEL = "spotdrain.kind"
# Environment the agent sets in the containers it starts (and tests/demo set by hand).
DEADLINE_FILE_ENV = "SPOTDRAIN_DEADLINE_FILE"
# Where the agent keeps the deadline file by default: on the host itself, a process not started
# by the agent (a Slurm job step) finds it here without the variable.
DEFAULT_DEADLINE_FILE = Path("/run/spotdrain/workload/deadline.json")
STATUS_DIR_ENV = "SPOTDRAIN_STATUS_DIR"

REASONS = ("notice", "pause")
MAX_DEADLINE_BYTES = 4096
MAX_REPORT_BYTES = 4096
MAX_RECLAIM_ID = 200
# Generation numbers and byte counts fit a JSON number that every reader holds exactly.
MAX_GENERATION = 2**53
MAX_BYTES = 2**53
CHECKPOINT_STARTED = "checkpoint_started"
CHECKPOINT_COMMITTED = "checkpoint_committed"
REPORT_KINDS = (CHECKPOINT_STARTED, CHECKPOINT_COMMITTED)


class DeadlineInvalid(ValueError):
    """The deadline file is there but is not a deadline this module can trust."""


class ReportInvalid(ValueError):
    """A status report that is not one (the agent records `workload_report_invalid`)."""


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _finite(doc: dict[str, Any], key: str, error: type[ValueError]) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise error(f"{key} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or not 0 <= value < 1e11:  # epoch seconds, before year 5138
        raise error(f"{key} must be finite epoch seconds, got {value!r}")
    return value


def _count(doc: dict[str, Any], key: str, bound: int) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReportInvalid(f"{key} must be an integer, got {value!r}")
    if not 0 <= value <= bound:
        raise ReportInvalid(f"{key} must be between 0 and {bound}, got {value}")
    return value


# --- the deadline file -------------------------------------------------------------------------


@dataclass(frozen=True)
class Deadline:
    """One reclamation's deadlines, as the deadline file gives them (absolute epoch seconds).

    `terminate_at` is D (the provider deletes the machine); `grace_deadline` is G, when the
    agent SIGKILLs what still runs (and a rental's `reclaim_at`). `reason`: "notice" (a
    provider's reclaim) or "pause" (the host's owner)."""

    reclaim_id: str
    terminate_at: float
    grace_deadline: float
    reason: str

    def __post_init__(self) -> None:
        if not isinstance(self.reclaim_id, str) or not 0 < len(self.reclaim_id) <= MAX_RECLAIM_ID:
            raise DeadlineInvalid(f"reclaim_id must be 1 to {MAX_RECLAIM_ID} characters")
        doc = {"terminate_at": self.terminate_at, "grace_deadline": self.grace_deadline}
        for key in doc:
            _finite(doc, key, DeadlineInvalid)
        if self.grace_deadline > self.terminate_at:
            raise DeadlineInvalid("grace_deadline is after terminate_at")
        if self.reason not in REASONS:
            raise DeadlineInvalid(f"reason must be one of {REASONS}, got {self.reason!r}")

    @property
    def reclaim_at(self) -> float:
        return self.grace_deadline

    def time_left(self, clock: Callable[[], float] = time.time) -> float:
        """Seconds left to the grace deadline G (negative once it has passed)."""
        return self.grace_deadline - clock()

    def to_json(self) -> dict[str, Any]:
        """The file's one definition: the times as ISO 8601 UTC (for people and other
        languages) and as epoch seconds (what readers use). `reclaim_at` is G, the same time
        the coordinator's Rental API gives a renter."""
        return {
            "reclaim_id": self.reclaim_id,
            "terminate_at": _iso(self.terminate_at),
            "grace_deadline": _iso(self.grace_deadline),
            "reclaim_at": _iso(self.grace_deadline),
            "terminate_at_epoch": self.terminate_at,
            "grace_deadline_epoch": self.grace_deadline,
            "reclaim_at_epoch": self.grace_deadline,
            "reason": self.reason,
        }

    @classmethod
    def from_json(cls, doc: Any) -> Deadline:
        if not isinstance(doc, dict):
            raise DeadlineInvalid("the deadline file must hold a JSON object")
        return cls(
            reclaim_id=doc.get("reclaim_id"),  # type: ignore[arg-type]  (checked in __post_init__)
            terminate_at=_finite(doc, "terminate_at_epoch", DeadlineInvalid),
            grace_deadline=_finite(doc, "grace_deadline_epoch", DeadlineInvalid),
            reason=doc.get("reason"),  # type: ignore[arg-type]
        )

    @classmethod
    def parse(cls, raw: bytes) -> Deadline:
        return cls.from_json(_load(raw, MAX_DEADLINE_BYTES, DeadlineInvalid, "deadline file "))


def _load(raw: bytes, limit: int, invalid: type[ValueError], what: str = "") -> Any:
    """A file's JSON, at most `limit` bytes, NaN and infinities refused; `invalid` says why."""
    if len(raw) > limit:
        raise invalid(f"{what}larger than {limit} bytes")
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f"{what}not JSON: {e}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number here")


def deadline_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The deadline file: `path`, else $SPOTDRAIN_DEADLINE_FILE (a container the agent started,
    a Slurm job whose TaskProlog exports it), else the agent's default path on the host."""
    if path is not None:
        return Path(path)
    env = os.environ.get(DEADLINE_FILE_ENV, "")
    return Path(env) if env else DEFAULT_DEADLINE_FILE


def read_deadline(path: str | os.PathLike[str] | None = None) -> Deadline | None:
    """The deadline now in force, or None while there is no deadline file.

    Raises DeadlineInvalid when the file is there but malformed. The agent replaces the file
    by rename, so a reader never sees half of one."""
    where = deadline_path(path)
    try:
        with open(where, "rb") as f:
            raw = f.read(MAX_DEADLINE_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return Deadline.parse(raw)


def write_atomic(path: Path, data: bytes, mode: int = 0o644, durable: bool = True) -> None:
    """Write `data` to `path` by rename: a reader sees the old file or the new one, whole, and
    already with `mode` (a reader may take and remove it at once). `durable`: fsync the file
    and then its directory, so the new content and its name both survive a power loss.

    The one atomic write of the project (the agent's state goes through it too). On any
    failure the old file is left as it was and the temporary file is removed: on a full disk
    its space is what the next try needs."""
    # Beside the target (a rename across filesystems is no rename), under a name of its own
    # (two writers never share one), hidden (the agent's readers skip dot names).
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            os.fchmod(fd, mode)  # mkstemp creates 0600, and the umask must not narrow `mode`
            # A nearly full disk may take part of a write without an error: write the rest
            # until it is all there or the disk says why not, never renaming a short file.
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        # The rename lives in the directory: without this a power loss may bring back the old
        # name, or none, even though the file's own data reached the disk.
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


# --- SIGTERM or the deadline file, once --------------------------------------------------------


class Reclaim:
    """Runs `callback(deadline)` once, in a thread of its own, on the first SIGTERM or the first
    sight of a valid deadline file, whichever comes first.

    `deadline` is the Deadline if the file is there by then, else None (a SIGTERM without a
    reclamation: `docker stop`, say). `trigger` says which came first ("sigterm" or
    "deadline_file"). The thread polls the file every `poll_s` (no inotify in the standard
    library); a SIGTERM wakes it at once through a pipe, so the callback starts within
    microseconds of the signal. `stimuli` lists every SIGTERM and deadline file seen, first one
    included, so a test can tell that a second one was seen and changed nothing.

    Must be started from the main thread (Python delivers signals there)."""

    def __init__(
        self,
        callback: Callable[[Deadline | None], None],
        deadline_file: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] = time.time,
        poll_s: float = 0.1,
    ) -> None:
        if not (math.isfinite(poll_s) and poll_s > 0):
            raise ValueError(f"poll_s must be positive seconds, got {poll_s!r}")
        self.callback = callback
        self.path = deadline_path(deadline_file)
        self.clock = clock
        self.poll_s = poll_s
        self.trigger = ""
        self.deadline: Deadline | None = None
        self.stimuli: list[tuple[str, float]] = []
        self.error: BaseException | None = None
        self.fired = threading.Event()  # the callback has started
        self.done = threading.Event()  # the callback has returned (or raised: see `error`)
        self.looks = 0  # times the thread has looked at the deadline file
        self._seen_file = False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous: Any = None
        self._thread: threading.Thread | None = None
        self._stop = False

    def start(self) -> Reclaim:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("spotdrain.workload.Reclaim must be started from the main thread")
        if self._thread is not None:
            raise RuntimeError("this Reclaim is started already")
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._thread = threading.Thread(target=self._watch, name="spotdrain-reclaim", daemon=True)
        self._thread.start()
        return self

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Only a write to a pipe here: the thread decides, so the callback can never run twice
        # and nothing in a signal handler waits on a lock.
        try:
            os.write(self._write_fd, b"T")
        except BlockingIOError:
            pass  # the pipe is full of earlier SIGTERMs: this one changes nothing anyway

    def _watch(self) -> None:
        while not self._stop:
            ready, _, _ = select.select([self._read_fd], [], [], self.poll_s)
            if ready:
                for byte in os.read(self._read_fd, 4096):
                    if byte == ord("T"):
                        self._stimulus("sigterm")
            self._look_at_file()

    def _look_at_file(self) -> None:
        if self._seen_file:
            return
        self.looks += 1
        try:
            deadline = read_deadline(self.path)
        except (DeadlineInvalid, OSError):
            return  # not a deadline (yet): the agent writes it by rename, so look again
        if deadline is None:
            return
        self._seen_file = True
        self.deadline = deadline
        self._stimulus("deadline_file")

    def _stimulus(self, what: str) -> None:
        self.stimuli.append((what, self.clock()))
        if self.fired.is_set():
            return  # once: a second SIGTERM or the file after the signal changes nothing
        self.trigger = what
        if self.deadline is None:
            self._look_at_file_quietly()
        self.fired.set()
        try:
            self.callback(self.deadline)
        except BaseException as e:  # noqa: BLE001 (kept for the workload to see)
            self.error = e
        finally:
            self.done.set()

    def _look_at_file_quietly(self) -> None:
        # A SIGTERM first: hand the callback the deadline if the file is already there, without
        # counting the file as a stimulus of its own yet.
        try:
            self.deadline = read_deadline(self.path)
        except (DeadlineInvalid, OSError):
            self.deadline = None

    def time_left(self) -> float | None:
        """Seconds to G by this Reclaim's clock: from the deadline file, read again now (None
        while there is none or it is malformed)."""
        try:
            deadline = read_deadline(self.path)
        except DeadlineInvalid:
            return None
        return None if deadline is None else deadline.time_left(self.clock)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the callback has returned; False on timeout."""
        return self.done.wait(timeout)

    def close(self) -> None:
        """Stop watching and put the previous SIGTERM handler back."""
        self._stop = True
        if self._thread is not None:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            try:
                os.write(self._write_fd, b"S")  # wakes the thread; not a SIGTERM
            except BlockingIOError:
                pass
            self._thread.join(self.poll_s * 4 + 1)
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def on_reclaim(
    callback: Callable[[Deadline | None], None],
    deadline_file: str | os.PathLike[str] | None = None,
    clock: Callable[[], float] = time.time,
    poll_s: float = 0.1,
) -> Reclaim:
    """Start a `Reclaim` (see there) and return it."""
    return Reclaim(callback, deadline_file, clock, poll_s).start()


# --- reports into the status directory ---------------------------------------------------------


def report_document(
    kind: str, generation: int, at: float, nbytes: int | None = None
) -> dict[str, Any]:
    """A report's one definition: {"report", "generation", "at"}, and "bytes" once committed."""
    doc: dict[str, Any] = {"report": kind, "generation": generation, "at": at}
    if nbytes is not None:
        doc["bytes"] = nbytes
    parse_report(json.dumps(doc).encode())  # the writer holds itself to the reader's checks
    return doc


@dataclass(frozen=True)
class Report:
    kind: str  # one of REPORT_KINDS
    generation: int
    at: float  # the workload's own clock (the agent records its own time beside it)
    nbytes: int | None = None  # checkpoint_committed only


def parse_report(raw: bytes) -> Report:
    """A report file's content, checked; ReportInvalid says what is wrong. Unknown extra keys
    are ignored (a newer module copied into an older image's agent keeps working)."""
    doc = _load(raw, MAX_REPORT_BYTES, ReportInvalid)
    if not isinstance(doc, dict):
        raise ReportInvalid("not a JSON object")
    kind = doc.get("report")
    if kind not in REPORT_KINDS:
        raise ReportInvalid(f"report must be one of {REPORT_KINDS}, got {kind!r}")
    generation = _count(doc, "generation", MAX_GENERATION)
    at = _finite(doc, "at", ReportInvalid)
    nbytes = None
    if kind == CHECKPOINT_COMMITTED:
        nbytes = _count(doc, "bytes", MAX_BYTES)
    elif "bytes" in doc:
        raise ReportInvalid(f"{kind} carries no bytes")
    return Report(kind, generation, at, nbytes)


def report_name(kind: str, generation: int, at_ns: int) -> str:
    """Report files sort in the order they were written (the agent reads them in that order)."""
    return f"{at_ns:020d}-{kind}-{generation}.json"


class Reporter:
    """Writes reports into a status directory (default $SPOTDRAIN_STATUS_DIR). With none set
    (not run by spotdrain), reports are skipped and return None."""

    def __init__(
        self,
        status_dir: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        env = os.environ.get(STATUS_DIR_ENV, "")
        self.dir = Path(status_dir) if status_dir is not None else Path(env) if env else None
        self.clock = clock
        self._last_ns = 0
        self._lock = threading.Lock()

    def checkpoint_started(self, generation: int) -> Path | None:
        return self._write(CHECKPOINT_STARTED, generation, None)

    def checkpoint_committed(self, generation: int, nbytes: int) -> Path | None:
        return self._write(CHECKPOINT_COMMITTED, generation, nbytes)

    def _write(self, kind: str, generation: int, nbytes: int | None) -> Path | None:
        now = self.clock()
        doc = report_document(kind, generation, now, nbytes)  # raises ReportInvalid when bad
        if self.dir is None:
            return None
        with self._lock:
            # Strictly increasing names, even for two reports within one clock tick.
            at_ns = max(int(now * 1e9), self._last_ns + 1)
            self._last_ns = at_ns
            path = self.dir / report_name(kind, generation, at_ns)
            write_atomic(path, json.dumps(doc, sort_keys=True).encode())
        return path


_default_reporter: Reporter | None = None


def _reporter() -> Reporter:
    global _default_reporter
    if _default_reporter is None:
        _default_reporter = Reporter()
    return _default_reporter


def checkpoint_started(generation: int) -> Path | None:
    """Report that checkpoint `generation` has started (into $SPOTDRAIN_STATUS_DIR)."""
    return _reporter().checkpoint_started(generation)


def checkpoint_committed(generation: int, nbytes: int) -> Path | None:
    """Report that checkpoint `generation` is committed, `nbytes` long."""
    return _reporter().checkpoint_committed(generation, nbytes)
