"""Build and drive the fake ``libnvidia-ml.so.1`` (tests/fakes/fakenvml/fake_nvml.c).

The real ``pynvml`` loads the fake through ``LD_LIBRARY_PATH``; the dynamic
loader reads that variable only at process start, so the fake can only be used
by a subprocess started with :meth:`FakeGpus.env` in its environment.

The library re-reads the state file on every call, so a test changes the GPUs
of a running process just by calling the methods below. State-file format (one
directive a line, ``#`` starts a comment; the C file's header is the reference):

    gpus <n>                                        # default 1, at most 64
    proc <gpu> <pid> <used_bytes> compute|graphics  # listed only while <pid> lives
    fault init_failed                               # nvmlInit -> DRIVER_NOT_LOADED
    fault gpu_lost [<gpu>]                          # device calls -> GPU_IS_LOST
    fault insufficient_size <n>                     # next n filled list calls -> INSUFFICIENT_SIZE
    fault slow_ms <n>                               # every call sleeps n ms first

A missing file means one GPU, no processes, no faults.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["GIB", "LIB_NAME", "SOURCE", "FakeGpus", "build"]

SOURCE = pathlib.Path(__file__).with_name("fake_nvml.c")
LIB_NAME = "libnvidia-ml.so.1"  # the soname pynvml dlopens on Linux
GIB = 1 << 30

Kind = Literal["compute", "graphics"]
FAULTS = ("init_failed", "gpu_lost", "insufficient_size", "slow_ms")


def build(out_dir: pathlib.Path) -> pathlib.Path:
    """Compile the fake into out_dir; return the directory for LD_LIBRARY_PATH."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / LIB_NAME
    if lib.exists() and lib.stat().st_mtime >= SOURCE.stat().st_mtime:
        return out_dir
    # Compile to a temp name then rename, so a concurrent build (pytest-xdist
    # workers sharing a dir) never dlopens a half-written file.
    tmp = out_dir / f".{LIB_NAME}.{os.getpid()}.tmp"
    cmd = ["cc", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-o", str(tmp), str(SOURCE)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"building the fake NVML failed: {' '.join(cmd)}\n{done.stderr}")
    os.replace(tmp, lib)
    return out_dir


@dataclass
class _Proc:
    pid: int
    gpu: int
    used_bytes: int
    kind: Kind


@dataclass
class FakeGpus:
    """The state file one test controls; every change rewrites it atomically."""

    path: pathlib.Path
    gpus: int = 1
    procs: list[_Proc] = field(default_factory=list)
    faults: dict[str, int | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._write()

    @property
    def counter_path(self) -> pathlib.Path:
        """Where the library counts injected INSUFFICIENT_SIZE results used up."""
        return self.path.with_name(self.path.name + ".counter")

    def env(self, lib_dir: pathlib.Path) -> dict[str, str]:
        """Environment additions for a subprocess that should see these GPUs."""
        ld = os.pathsep.join(p for p in (str(lib_dir), os.environ.get("LD_LIBRARY_PATH")) if p)
        return {"LD_LIBRARY_PATH": ld, "FAKE_NVML_STATE": str(self.path)}

    def set(self, gpus: int = 1) -> None:
        if not 0 <= gpus <= 64:
            raise ValueError(f"gpus must be 0..64, got {gpus}")
        self.gpus = gpus
        self._write()

    def add_process(
        self, pid: int, gpu: int = 0, used_bytes: int = 1 * GIB, kind: Kind = "compute"
    ) -> None:
        if pid <= 0 or gpu < 0 or used_bytes < 0 or kind not in ("compute", "graphics"):
            raise ValueError(f"bad process {pid=} {gpu=} {used_bytes=} {kind=}")
        self.procs.append(_Proc(pid, gpu, used_bytes, kind))
        self._write()

    def remove_process(self, pid: int) -> None:
        """Drop every entry for pid (a process that exits disappears by itself)."""
        self.procs = [p for p in self.procs if p.pid != pid]
        self._write()

    def fault(self, name: str, arg: int | None = None) -> None:
        """Inject a fault; see the module docstring for names and arguments."""
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
        if name in ("insufficient_size", "slow_ms") and arg is None:
            raise ValueError(f"fault {name} needs an argument")
        if name == "init_failed" and arg is not None:
            raise ValueError("fault init_failed takes no argument")
        if name == "insufficient_size":
            # A fresh budget of n: forget results used up by an earlier injection.
            self.counter_path.unlink(missing_ok=True)
        self.faults[name] = arg
        self._write()

    def clear_faults(self) -> None:
        self.faults.clear()
        self.counter_path.unlink(missing_ok=True)
        self._write()

    def render(self) -> str:
        lines = [f"gpus {self.gpus}"]
        lines += [f"proc {p.gpu} {p.pid} {p.used_bytes} {p.kind}" for p in self.procs]
        for name, arg in self.faults.items():
            lines.append(f"fault {name}" if arg is None else f"fault {name} {arg}")
        return "\n".join(lines) + "\n"

    def _write(self) -> None:
        # The library re-reads the file on every call from other processes:
        # temp file + rename means it sees the old or the new state, never half.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.render())
            os.replace(tmp, self.path)
        except BaseException:
            pathlib.Path(tmp).unlink(missing_ok=True)
            raise
