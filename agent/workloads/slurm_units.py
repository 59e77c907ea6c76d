"""A Slurm job as a work unit: its id on the node (`slurm:<jobid>`), what ended it, and a
signal to one of its steps' processes sent the way slurmd sends it."""

from __future__ import annotations

import os
import signal as signals
from dataclasses import dataclass

from spotdrain.agent.core.reclamation_commands import SIGKILL, SIGTERM
from spotdrain.agent.workloads.slurm_cli import JobInfo

KIND = "slurm"
UNIT_PREFIX = "slurm:"


@dataclass(frozen=True)
class SlurmUnit:
    """A job on this node, as a work unit."""

    id: str  # slurm:<jobid>
    name: str
    job_id: int
    requeue: bool = False  # a batch job Slurm may requeue
    kind: str = KIND
    image: str = ""


def unit_id(job_id: int) -> str:
    return f"{UNIT_PREFIX}{job_id}"


def job_of(unit: str) -> int:
    return int(unit.removeprefix(UNIT_PREFIX))


def unit_of(job: JobInfo) -> SlurmUnit:
    return SlurmUnit(unit_id(job.job_id), job.name, job.job_id, job.requeue and job.batch)


def exit_code_of(info: JobInfo | None) -> int:
    """As a shell (and Docker) says it: 128 + the signal that ended the job (137: killed), else
    its exit status; -1 when the controller could not tell."""
    if info is None or info.exit_code is None:
        return -1
    return 128 + info.exit_signal if info.exit_signal else info.exit_code


def signal_process(pid: int, signal: str) -> str:
    """Signal one step process as slurmd would: SIGCONT first (a stopped task must see the
    TERM), and srun left out of a TERM (its tasks get it from their own slurmstepd; srun
    turns a TERM into a KILL for them)."""
    try:
        if signal == SIGTERM:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "srun":
                    return ""
            os.kill(pid, signals.SIGCONT)
        os.kill(pid, signals.SIGKILL if signal == SIGKILL else signals.SIGTERM)
    except (FileNotFoundError, ProcessLookupError):
        return ""  # gone already
    except OSError as e:
        return f"kill({pid}): {e.strerror}"
    return ""
