"""Slurm's command-line tools, spoken to through asyncio subprocesses (no pyslurm: it has no build
for 22.05 and its calls block). Every call has a timeout, kills the tool when it passes, and
raises SlurmError on a non-zero exit, a timeout or an error on stderr; output is parsed with
bounded lengths and checked integers, so a strange answer is an error, never a guess.

Verified on Debian's 22.05.8: `scancel JOB` and `scontrol requeue JOB` both send SIGCONT then
SIGTERM to the batch shell and every step's processes, and slurmd sends SIGKILL KillWait seconds
later (the job shows COMPLETING meanwhile). `scancel` of an unknown job exits 0, silent unless
--verbose. A requeued job restarts no sooner than cred_expire (AuthInfo, default 120 s) later.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

from spotdrain.protocol import limits

MAX_OUTPUT = 4 << 20  # bytes of a tool's stdout; a node's jobs fit many times over
MAX_TEXT = 512  # a name, a reason, a state: longer is cut, never trusted whole
MAX_STDERR = 4096
_INT = re.compile(r"[0-9]{1,18}")
# `Key=value` tokens of `scontrol -o show`: keys such as ReqB:S:C:T or CPUs/Task; a value may hold
# spaces (JobName, Reason), so it runs up to the next key.
_KEY = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")
# scontrol appends who set a node's reason and when: `Reason=text [root@2026-12-03T15:32:14]`.
_REASON_STAMP = re.compile(r"\s*\[[^\]\s]*@[^\]\s]*\]$")
_JOB_FORMAT = "JobID:|,State:|,Requeue:|,BatchFlag:|,Name:"  # Name last: it may hold a `|`
# stderr of `scontrol listpids` that means "nothing of Slurm runs here", with exit 1. An unknown
# node also prints the first, after an `error:` line about its missing spool directory.
_NO_STEPS = (
    "No job steps exist on this node",
    "There are no steps for job",
    "does not exist on node",
)


class SlurmError(Exception):
    """A Slurm call failed, timed out or answered something this module cannot read."""


class SlurmTimeout(SlurmError):
    """A Slurm call got no answer within its bound (the tool was killed)."""


@dataclass(frozen=True)
class NodeInfo:
    name: str
    state: str  # the base state: IDLE, MIXED, ALLOCATED, DOWN...
    flags: frozenset[str]  # DRAIN, COMPLETING, NOT_RESPONDING...
    reason: str  # without scontrol's `[user@time]` stamp; "" when none
    cpu_alloc: int

    @property
    def drained(self) -> bool:
        """Slurm's own `drained`: sinfo says `draining` while a job or its completion remains."""
        return (
            "DRAIN" in self.flags
            and self.cpu_alloc == 0
            and "COMPLETING" not in self.flags
            and self.state not in ("MIXED", "ALLOCATED")
        )

    @property
    def draining(self) -> bool:
        return "DRAIN" in self.flags and not self.drained


@dataclass(frozen=True)
class JobInfo:
    job_id: int
    name: str
    state: str  # RUNNING, COMPLETING, PENDING, CANCELLED...
    requeue: bool
    batch: bool
    exit_code: int | None  # the job's exit status; None where the call does not tell it
    exit_signal: int | None = None  # the signal that ended it (ExitCode=0:9), 0 for none


def _int(text: str, what: str) -> int:
    if not _INT.fullmatch(text):
        raise SlurmError(f"{what}: not an integer: {text[:40]!r}")
    return int(text)


def _flag(text: str, what: str) -> bool:
    if text not in ("0", "1"):
        raise SlurmError(f"{what}: not 0 or 1: {text[:40]!r}")
    return text == "1"


def _text(value: str) -> str:
    return value.strip()[:MAX_TEXT]


def parse_show(line: str) -> dict[str, str]:
    """One line of `scontrol -o show node|job` as its fields (the first of a repeated key wins:
    NodeList appears more than once in a job)."""
    fields: dict[str, str] = {}
    matches = list(_KEY.finditer(line))
    for here, after in zip(matches, [*matches[1:], None], strict=True):
        end = after.start() if after is not None else len(line)
        fields.setdefault(here.group(1), line[here.end() : end].strip())
    return fields


def parse_node(line: str) -> NodeInfo:
    fields = parse_show(line)
    if "NodeName" not in fields or "State" not in fields:
        raise SlurmError(f"no NodeName/State in {line[:200]!r}")
    state, *flags = fields["State"].split("+")
    reason = fields.get("Reason", "")
    return NodeInfo(
        name=_text(fields["NodeName"]),
        state=_text(state.rstrip("*~#!%$@^-")),
        flags=frozenset(_text(f) for f in flags),
        reason=_text(_REASON_STAMP.sub("", reason)) if reason != "(null)" else "",
        cpu_alloc=_int(fields.get("CPUAlloc", ""), "CPUAlloc"),
    )


def parse_job(line: str) -> JobInfo:
    fields = parse_show(line)
    code, _, signal = fields.get("ExitCode", "").partition(":")
    return JobInfo(
        job_id=_int(fields.get("JobId", ""), "JobId"),
        name=_text(fields.get("JobName", "")),
        state=_text(fields.get("JobState", "")),
        requeue=_flag(fields.get("Requeue", ""), "Requeue"),
        batch=_flag(fields.get("BatchFlag", ""), "BatchFlag"),
        exit_code=_int(code, "ExitCode"),
        exit_signal=_int(signal, "ExitCode signal"),
    )


def parse_squeue(out: str) -> list[JobInfo]:
    jobs = []
    for line in out.splitlines():
        parts = line.split("|", 4)
        if len(parts) != 5:
            raise SlurmError(f"squeue: unreadable line {line[:200]!r}")
        job_id, state, requeue, batch, name = parts
        jobs.append(
            JobInfo(
                job_id=_int(job_id.strip(), "squeue JobID"),
                name=_text(name),
                state=_text(state),
                requeue=_flag(requeue.strip(), "squeue Requeue"),
                batch=_flag(batch.strip(), "squeue BatchFlag"),
                exit_code=None,
            )
        )
    return jobs


def parse_listpids(out: str) -> dict[int, list[int]]:
    """`PID JOBID STEPID LOCALID GLOBALID` rows under a header: job id -> its pids."""
    pids: dict[int, list[int]] = {}
    for line in out.splitlines()[1:]:
        cols = line.split()
        if not cols:
            continue
        if len(cols) < 3:
            raise SlurmError(f"listpids: unreadable line {line[:200]!r}")
        job = _int(cols[1], "listpids JOBID")
        pids.setdefault(job, []).append(_int(cols[0], "listpids PID"))
    return pids


def parse_config(out: str) -> dict[str, str]:
    """`Key = value` lines of `scontrol show config`; headings and blank lines are skipped."""
    config = {}
    for line in out.splitlines():
        key, sep, value = line.partition(" = ")
        if sep and key.strip() and " " not in key.strip():
            config[key.strip()] = value.strip()[:MAX_TEXT]
    return config


class SlurmCli:
    """The calls the agent makes of one Slurm cluster, from one node."""

    def __init__(self, bin_dir: Path | str, conf: Path | str, timeout_s: float) -> None:
        self.bin_dir = Path(bin_dir)
        self.conf = str(conf)
        self.timeout_s = timeout_s

    async def _run(
        self, tool: str, *args: str, ok_rcs: tuple[int, ...] = (0,), timeout_s: float | None = None
    ) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of one tool, killed at the timeout."""
        what = f"{tool} {' '.join(args)}"[:300]
        try:
            proc = await asyncio.create_subprocess_exec(
                str(self.bin_dir / tool),
                *args,
                env={"SLURM_CONF": self.conf, "LC_ALL": "C", "PATH": "/usr/bin:/bin"},
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as e:
            raise SlurmError(f"{what}: cannot run: {e}") from None
        bound = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(bound):
                out, err = await proc.communicate()
        except TimeoutError:
            raise SlurmTimeout(f"{what}: no answer within {bound} s") from None
        finally:
            if proc.returncode is None:  # timed out or cancelled: never leave it running
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        stderr = err.decode(errors="replace").strip()[:MAX_STDERR]
        if proc.returncode not in ok_rcs:
            # scontrol prints some refusals on stdout ("Node x not found").
            said = stderr or out.decode(errors="replace").strip()[:MAX_TEXT] or "(no message)"
            raise SlurmError(f"{what}: exit {proc.returncode}: {said}")
        if len(out) > MAX_OUTPUT:
            raise SlurmError(f"{what}: {len(out)} bytes of output, more than {MAX_OUTPUT}")
        return proc.returncode, out.decode(errors="replace"), stderr

    async def _act(self, tool: str, *args: str) -> None:
        """A call that changes something: success is exit 0 with nothing on stderr (scancel
        reports some failures on stderr only)."""
        _, _, stderr = await self._run(tool, *args)
        if stderr:
            raise SlurmError(f"{tool} {' '.join(args)}"[:300] + f": {stderr}")

    async def drain(self, node: str, reason: str) -> None:
        await self._act("scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}")

    async def resume(self, node: str) -> None:
        await self._act("scontrol", "update", f"NodeName={node}", "State=RESUME")

    async def node(self, node: str) -> NodeInfo:
        _, out, _ = await self._run("scontrol", "-o", "show", "node", node)
        lines = [line for line in out.splitlines() if line.strip()]
        if len(lines) != 1:
            raise SlurmError(f"scontrol show node {node}: {len(lines)} lines, not one")
        info = parse_node(lines[0])
        if info.name != node:
            raise SlurmError(f"scontrol show node {node}: answered for {info.name!r}")
        return info

    async def jobs_on(self, node: str) -> list[JobInfo]:
        """The node's jobs that hold or are leaving it: running, suspended, stopped, configuring
        (CF, R, S, ST)."""
        _, out, _ = await self._run(
            "squeue", "-h", "-w", node, "-t", "CF,R,S,ST", "-O", _JOB_FORMAT
        )
        return parse_squeue(out)

    async def job(self, job_id: int) -> JobInfo | None:
        """The job as the controller knows it; None once it does not (never was, or purged after
        MinJobAge)."""
        rc, out, stderr = await self._run(
            "scontrol", "-o", "show", "job", str(job_id), ok_rcs=(0, 1)
        )
        if rc == 1:
            if "Invalid job id" in stderr:
                return None
            raise SlurmError(f"scontrol show job {job_id}: exit 1: {stderr or '(no message)'}")
        lines = [line for line in out.splitlines() if line.strip()]
        if len(lines) != 1:
            raise SlurmError(f"scontrol show job {job_id}: {len(lines)} lines, not one")
        info = parse_job(lines[0])
        if info.job_id != job_id:
            raise SlurmError(f"scontrol show job {job_id}: answered for {info.job_id}")
        return info

    async def requeue(self, job_id: int) -> None:
        await self._act("scontrol", "requeue", str(job_id))

    async def cancel(self, job_id: int) -> None:
        """scancel: a job already completing or gone from the node is no error (it is leaving);
        an unknown job is. Only --verbose makes scancel tell either, on stderr, still exiting 0."""
        _, _, stderr = await self._run("scancel", "--verbose", str(job_id))
        errors = [line for line in stderr.splitlines() if "error:" in line]
        if any("already completing or completed" not in line for line in errors):
            raise SlurmError(f"scancel {job_id}: {'; '.join(errors)[:MAX_TEXT]}")

    async def listpids(self, node: str, job_id: int | None = None) -> dict[int, list[int]]:
        """Job id -> pids of Slurm's processes on node, from the node's own slurmstepd (answers
        without the controller). Exit 1 saying no steps exist is an empty answer."""
        target = "*" if job_id is None else str(job_id)
        rc, out, stderr = await self._run("scontrol", "listpids", target, node, ok_rcs=(0, 1))
        if rc == 1:
            if "error:" not in stderr and any(sign in stderr for sign in _NO_STEPS):
                return {}
            raise SlurmError(f"scontrol listpids {target} {node}: exit 1: {stderr}")
        return parse_listpids(out)

    async def config(self) -> dict[str, str]:
        _, out, _ = await self._run("scontrol", "show", "config")
        return parse_config(out)

    async def cluster_name(self) -> str:
        """ClusterName, refused when the coordinator would refuse a registration carrying it."""
        name = (await self.config()).get("ClusterName", "")
        if len(name) > limits.MAX_MANAGER_CHARS or not name.isprintable():
            raise SlurmError(f"ClusterName {name[:80]!r}: too long or unprintable to send")
        return name

    async def kill_wait_s(self) -> int:
        """KillWait: seconds between slurmd's SIGTERM and its SIGKILL (`5 sec`)."""
        value = (await self.config()).get("KillWait", "")
        number, _, unit = value.partition(" ")
        if unit not in ("sec", ""):
            raise SlurmError(f"KillWait: unexpected unit in {value!r}")
        return _int(number, "KillWait")

    async def ping(self) -> bool:
        """Whether the primary slurmctld answers; no answer in time is a no, not an error."""
        try:
            _, out, _ = await self._run("scontrol", "ping", ok_rcs=(0, 1))
        except SlurmTimeout:
            return False
        return "is UP" in out
