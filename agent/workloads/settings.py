"""Which work managers the agent drains ([workloads] in its config file), checked at start.

```toml
[workloads]
docker = true                     # the Docker backend (default true)
[workloads.slurm]                 # present: the Slurm backend is on
node_name = "gpu-017"             # this host's NodeName in slurm.conf (default: hostname -s)
bin_dir = "/usr/bin"              # where scontrol, squeue, sinfo, scancel live
conf = "/etc/slurm/slurm.conf"    # passed to them as SLURM_CONF
requeue = true                    # requeue requeueable batch jobs (false: cancel every job)
call_timeout_s = 5
```
A wrong key is one line and exit 2 (UsageError), like every other setting.
"""

from __future__ import annotations

import math
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotdrain.runtime.cli import UsageError

SLURM_TOOLS = ("scontrol", "squeue", "scancel", "sinfo")
# slurm.conf's NodeName: a hostname-like word (Slurm itself allows little more).
_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_CALL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SlurmSettings:
    node_name: str
    bin_dir: Path = Path("/usr/bin")
    conf: Path = Path("/etc/slurm/slurm.conf")
    requeue: bool = True
    call_timeout_s: float = 5.0


@dataclass(frozen=True)
class WorkloadSettings:
    docker: bool = True
    slurm: SlurmSettings | None = None


def parse_workloads(doc: Any, where: str) -> WorkloadSettings:
    if doc is None:
        return WorkloadSettings()
    if not isinstance(doc, dict):
        raise UsageError(f"{where}[workloads] must be a table")
    unknown = sorted(set(doc) - {"docker", "slurm"})
    if unknown:
        raise UsageError(f"{where}unknown setting workloads.{unknown[0]}")
    docker = doc.get("docker", True)
    if not isinstance(docker, bool):
        raise UsageError(f"{where}workloads.docker must be true or false")
    slurm = None if "slurm" not in doc else _slurm(doc["slurm"], f"{where}workloads.slurm.")
    if not docker and slurm is None:
        raise UsageError(f"{where}[workloads] turns every backend off (docker, slurm)")
    return WorkloadSettings(docker, slurm)


def _slurm(table: Any, where: str) -> SlurmSettings:
    if not isinstance(table, dict):
        raise UsageError(f"{where[:-1]} must be a table")
    unknown = sorted(set(table) - {"node_name", "bin_dir", "conf", "requeue", "call_timeout_s"})
    if unknown:
        raise UsageError(f"{where}{unknown[0]}: unknown setting")
    node_name = table.get("node_name", socket.gethostname().split(".")[0])
    if not isinstance(node_name, str) or not _NODE_NAME.fullmatch(node_name):
        raise UsageError(f"{where}node_name must be a Slurm node name, got {node_name!r}")
    bin_dir = _path(table.get("bin_dir", str(SlurmSettings.bin_dir)), f"{where}bin_dir")
    missing = [t for t in SLURM_TOOLS if not os.access(bin_dir / t, os.X_OK)]
    if missing:
        raise UsageError(f"{where}bin_dir {bin_dir} has no executable {missing[0]}")
    conf = _path(table.get("conf", str(SlurmSettings.conf)), f"{where}conf")
    if not conf.is_file() or not os.access(conf, os.R_OK):
        raise UsageError(f"{where}conf {conf} is not a readable file")
    requeue = table.get("requeue", True)
    if not isinstance(requeue, bool):
        raise UsageError(f"{where}requeue must be true or false")
    timeout = table.get("call_timeout_s", SlurmSettings.call_timeout_s)
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or not 0 < timeout <= MAX_CALL_TIMEOUT_S
    ):
        raise UsageError(
            f"{where}call_timeout_s must be a number in (0, {MAX_CALL_TIMEOUT_S:g}], "
            f"got {timeout!r}"
        )
    return SlurmSettings(node_name, bin_dir, conf, requeue, float(timeout))


def _path(raw: Any, where: str) -> Path:
    if not isinstance(raw, str) or not raw or "\0" in raw or not raw.startswith("/"):
        raise UsageError(f"{where} must be an absolute path, got {raw!r}")
    return Path(raw)
