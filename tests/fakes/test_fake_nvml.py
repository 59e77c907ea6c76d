"""The fake libnvidia-ml.so.1, driven through the real pynvml in a subprocess.

LD_LIBRARY_PATH is read by the loader only at process start, so every check
talks to a long-lived "probe" subprocess over stdin/stdout. The probe keeps the
library loaded, which also proves the fake re-reads its state on every call.
"""

from __future__ import annotations

import json
import os
import pathlib
import select
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fakes.fakenvml import GIB, FakeGpus, build
from fakes.waiting import wait_until

# One request a line ("op arg..."), one JSON reply a line:
# {"ok": value} or {"error": "<pynvml exception class>"}, plus "s": call seconds.
PROBE = r"""
import ctypes, json, sys, threading, time
import pynvml as N

H = {}  # handles are fetched once, as a long-running agent would
def h(i):
    i = int(i)
    if i not in H:
        H[i] = N.nvmlDeviceGetHandleByIndex(i)
    return H[i]

def procs(lst):
    return [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in lst]

def compute_retry(i):
    # What a caller must do: pynvml oversizes its buffer once, then gives up
    # with NVMLError_InsufficientSize if processes keep appearing.
    for attempt in range(1, 11):
        try:
            return [attempt, procs(N.nvmlDeviceGetComputeRunningProcesses(h(i)))]
        except N.NVMLError_InsufficientSize:
            continue
    raise RuntimeError("still insufficient after 10 attempts")

def raw_compute(i, n):
    # The bare C contract, without pynvml's sizing logic.
    n = int(n)
    fn = N._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
    count = ctypes.c_uint(n)
    buf = (N.c_nvmlProcessInfo_v3_t * n)() if n else None
    ret = fn(h(i), ctypes.byref(count), buf)
    pids = [buf[k].pid for k in range(count.value)] if ret == 0 and buf else []
    return [ret, count.value, pids]

def threads(i, n):
    # Many threads on one loaded library: every answer must be whole.
    seen, errors = [], []
    def work():
        try:
            for _ in range(int(n)):
                got = N.nvmlDeviceGetComputeRunningProcesses(h(i))
                seen.append(sorted(p.pid for p in got))
        except Exception as e:
            errors.append(repr(e))
    ts = [threading.Thread(target=work) for _ in range(8)]
    for t in ts: t.start()
    for t in ts: t.join()
    return [sorted({json.dumps(s) for s in seen}), errors]

def mem2(i):
    m = N.nvmlDeviceGetMemoryInfo(h(i), version=N.nvmlMemory_v2)
    return [m.total, m.reserved, m.free, m.used]

OPS = {
    "init": N.nvmlInit,
    "shutdown": N.nvmlShutdown,
    "driver": N.nvmlSystemGetDriverVersion,
    "count": N.nvmlDeviceGetCount,
    "handle": lambda i: N.nvmlDeviceGetHandleByIndex(int(i)) and None,
    "name": lambda i: N.nvmlDeviceGetName(h(i)),
    "uuid": lambda i: N.nvmlDeviceGetUUID(h(i)),
    "mem": lambda i: (lambda m: [m.total, m.free, m.used])(N.nvmlDeviceGetMemoryInfo(h(i))),
    "mem2": mem2,
    "compute": lambda i: procs(N.nvmlDeviceGetComputeRunningProcesses(h(i))),
    "graphics": lambda i: procs(N.nvmlDeviceGetGraphicsRunningProcesses(h(i))),
    "compute_retry": compute_retry,
    "raw_compute": raw_compute,
    "threads": threads,
}

for line in sys.stdin:
    op, *args = line.split()
    t0 = time.perf_counter()
    try:
        out = {"ok": OPS[op](*args)}
    except N.NVMLError as e:
        out = {"error": type(e).__name__}
    out["s"] = time.perf_counter() - t0
    print(json.dumps(out), flush=True)
"""

NA = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId without MIG
REPLY_TIMEOUT_S = 20.0


class Probe:
    """A python process with the fake loaded through the real pynvml."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PROBE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, **env},
            text=True,
            bufsize=1,
        )

    def call(self, op: str, *args: object) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(" ".join([op, *map(str, args)]) + "\n")
        self.proc.stdin.flush()
        # One reply per request, so nothing is left in Python's buffer and
        # select() on the pipe is a fair timeout; a hung fake fails the test.
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        if not ready:
            raise TimeoutError(f"probe gave no reply to {op} {args}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"probe exited with {self.proc.wait()} on {op} {args}")
        return json.loads(line)

    def ok(self, op: str, *args: object) -> Any:
        reply = self.call(op, *args)
        assert "ok" in reply, f"{op} {args}: {reply}"
        return reply["ok"]

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


@pytest.fixture(scope="session")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return build(tmp_path_factory.mktemp("fakenvml"))


@pytest.fixture
def gpus(tmp_path: pathlib.Path) -> FakeGpus:
    return FakeGpus(tmp_path / "nvml-state")


@pytest.fixture
def probe(fake_lib: pathlib.Path, gpus: FakeGpus) -> Iterator[Callable[..., Probe]]:
    started: list[Probe] = []

    def start(init: bool = True, env: dict[str, str] | None = None) -> Probe:
        p = Probe(env if env is not None else gpus.env(fake_lib))
        started.append(p)
        if init:
            p.ok("init")
        return p

    yield start
    for p in started:
        p.close()


@pytest.fixture
def sleeper() -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        p = subprocess.Popen(["sleep", "30"])
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()
        p.wait()


def wait_for_zombie(pid: int, timeout: float = 5.0) -> None:
    def zombie() -> bool:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] == "Z"

    wait_until(zombie, timeout, f"{pid} a zombie", every=0.01)


def test_build_skips_when_up_to_date(fake_lib: pathlib.Path) -> None:
    lib = fake_lib / "libnvidia-ml.so.1"
    before = lib.stat().st_mtime_ns
    assert build(fake_lib) == fake_lib
    assert lib.stat().st_mtime_ns == before


def test_init_lists_gpus(probe: Callable[..., Probe], gpus: FakeGpus) -> None:
    gpus.set(gpus=3)
    p = probe()
    assert p.ok("count") == 3
    assert p.ok("driver")
    names = [p.ok("name", i) for i in range(3)]
    uuids = [p.ok("uuid", i) for i in range(3)]
    assert names == ["NVIDIA H200 (fake)"] * 3
    assert len(set(uuids)) == 3 and all(u.startswith("GPU-") for u in uuids)
    assert p.ok("mem", 0) == [141 * GIB, 141 * GIB, 0]
    assert p.ok("mem2", 0) == [141 * GIB, 0, 141 * GIB, 0]
    assert p.ok("compute", 0) == []
    assert p.call("handle", 3)["error"] == "NVMLError_InvalidArgument"
    # The count follows the state file while the library stays loaded.
    gpus.set(gpus=2)
    assert p.ok("count") == 2
    assert p.ok("shutdown") is None
    assert p.call("count")["error"] == "NVMLError_Uninitialized"


def test_missing_state_file_means_one_idle_gpu(
    probe: Callable[..., Probe], fake_lib: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    env = FakeGpus(tmp_path / "unused").env(fake_lib)
    env["FAKE_NVML_STATE"] = str(tmp_path / "does-not-exist")
    p = probe(env=env)
    assert p.ok("count") == 1
    assert p.ok("compute", 0) == []


def test_bad_state_file_is_an_error(probe: Callable[..., Probe], gpus: FakeGpus) -> None:
    gpus.path.write_text("gpus lots\n")
    p = probe(init=False)
    assert p.call("init")["error"] == "NVMLError_Unknown"


def test_process_listed_until_it_really_exits(
    probe: Callable[..., Probe], gpus: FakeGpus, sleeper: Callable[[], subprocess.Popen[bytes]]
) -> None:
    child = sleeper()
    gpus.add_process(child.pid, used_bytes=3 * GIB)
    p = probe()
    assert p.ok("compute", 0) == [[child.pid, 3 * GIB, NA, NA]]
    assert p.ok("mem", 0) == [141 * GIB, 138 * GIB, 3 * GIB]
    child.kill()
    wait_for_zombie(child.pid)  # dead but not reaped: already off the GPU
    assert p.ok("compute", 0) == []
    child.wait()
    assert p.ok("compute", 0) == []
    assert p.ok("mem", 0) == [141 * GIB, 141 * GIB, 0]


def test_compute_and_graphics_are_listed_apart(
    probe: Callable[..., Probe], gpus: FakeGpus, sleeper: Callable[[], subprocess.Popen[bytes]]
) -> None:
    a, b, c = sleeper(), sleeper(), sleeper()
    gpus.set(gpus=2)
    gpus.add_process(a.pid, gpu=0, used_bytes=GIB, kind="compute")
    gpus.add_process(b.pid, gpu=0, used_bytes=2 * GIB, kind="graphics")
    gpus.add_process(c.pid, gpu=1, used_bytes=4 * GIB, kind="compute")
    p = probe()
    assert p.ok("compute", 0) == [[a.pid, GIB, NA, NA]]
    assert p.ok("graphics", 0) == [[b.pid, 2 * GIB, NA, NA]]
    assert p.ok("compute", 1) == [[c.pid, 4 * GIB, NA, NA]]
    assert p.ok("graphics", 1) == []
    assert p.ok("mem", 0)[2] == 3 * GIB
    gpus.remove_process(a.pid)
    assert p.ok("compute", 0) == []


def test_gpu_lost(probe: Callable[..., Probe], gpus: FakeGpus) -> None:
    gpus.set(gpus=2)
    p = probe()
    assert p.ok("compute", 1) == []  # handle fetched before the loss
    gpus.fault("gpu_lost", 1)
    assert p.call("compute", 1)["error"] == "NVMLError_GpuIsLost"
    assert p.call("mem", 1)["error"] == "NVMLError_GpuIsLost"
    assert p.call("handle", 1)["error"] == "NVMLError_GpuIsLost"
    assert p.ok("compute", 0) == []
    assert p.ok("count") == 2
    gpus.fault("gpu_lost")
    assert p.call("compute", 0)["error"] == "NVMLError_GpuIsLost"
    gpus.clear_faults()
    assert p.ok("compute", 1) == []


def test_init_failed(probe: Callable[..., Probe], gpus: FakeGpus) -> None:
    gpus.fault("init_failed")
    p = probe(init=False)
    assert p.call("init")["error"] == "NVMLError_DriverNotLoaded"
    gpus.clear_faults()
    assert p.ok("init") is None
    assert p.ok("count") == 1


def test_insufficient_size_contract(
    probe: Callable[..., Probe], gpus: FakeGpus, sleeper: Callable[[], subprocess.Popen[bytes]]
) -> None:
    a, b = sleeper(), sleeper()
    gpus.add_process(a.pid)
    gpus.add_process(b.pid)
    p = probe()
    assert p.ok("raw_compute", 0, 0) == [7, 2, []]  # sizing call
    assert p.ok("raw_compute", 0, 1) == [7, 2, []]  # too small
    assert p.ok("raw_compute", 0, 8) == [0, 2, [a.pid, b.pid]]
    gpus.fault("insufficient_size", 1)
    assert p.ok("raw_compute", 0, 0) == [7, 2, []]  # sizing calls use up nothing
    assert p.ok("raw_compute", 0, 8) == [7, 9, []]  # "more appeared": bigger count
    assert p.ok("raw_compute", 0, 9) == [0, 2, [a.pid, b.pid]]


def test_insufficient_size_retries_through_pynvml(
    probe: Callable[..., Probe], gpus: FakeGpus, sleeper: Callable[[], subprocess.Popen[bytes]]
) -> None:
    child = sleeper()
    gpus.add_process(child.pid, used_bytes=5 * GIB)
    gpus.fault("insufficient_size", 3)
    p = probe()
    # pynvml's own sizing gives up after one oversized retry...
    assert p.call("compute", 0)["error"] == "NVMLError_InsufficientSize"
    # ...so a caller that retries gets the right answer once the burst passes.
    assert p.ok("compute_retry", 0) == [3, [[child.pid, 5 * GIB, NA, NA]]]
    assert p.ok("compute", 0) == [[child.pid, 5 * GIB, NA, NA]]


def test_slow_calls(probe: Callable[..., Probe], gpus: FakeGpus) -> None:
    p = probe()
    fast = p.call("count")["s"]
    gpus.fault("slow_ms", 200)
    slow = p.call("count")["s"]
    assert slow > 0.8 * 0.200
    assert slow > fast


def test_threads_see_whole_answers(
    probe: Callable[..., Probe], gpus: FakeGpus, sleeper: Callable[[], subprocess.Popen[bytes]]
) -> None:
    kids = [sleeper() for _ in range(3)]
    for k in kids:
        gpus.add_process(k.pid)
    p = probe()
    answers, errors = p.ok("threads", 0, 50)
    assert errors == []
    assert answers == [json.dumps(sorted(k.pid for k in kids))]
