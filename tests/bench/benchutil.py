"""What the benchmarks in this directory share: percentiles, a summary row, the environment, and
one table format; for those on a real Docker engine (notice_to_sigterm.py, source_to_sigterm.py)
the SIGTERM probe reader, fresh workload containers, per-scenario results and the breakdown of
the agent's time from its own events. Not a benchmark itself; pytest collects nothing here.

Importers put tests/ on sys.path first (dockerenv lives there)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import random
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors

from fakes.dockerenv import (
    BASE_IMAGE,
    SignalProbe,
    ensure_engine,
    ensure_images,
    remove_test_containers,
    wait_ready,
    workload_command,
)

PROBE_TIMEOUT_S = 10.0
CONTAINER_PREFIX = "sdbench-"


def say(text: str) -> None:
    print(f"bench: {text}", flush=True)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    if not s:
        return float("nan")
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50_ms": percentile(values, 0.50),
        "p99_ms": percentile(values, 0.99),
        "max_ms": max(values),
        "mean_ms": statistics.fmean(values),
        "min_ms": min(values),
        "first_ms": values[0],
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def base_environment() -> dict[str, Any]:
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": load,
    }


def print_environment(env: dict[str, Any]) -> None:
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))


def table(rows: list[tuple[str, dict[str, float], str]], width: int = 44) -> None:
    """One line per (name, summary, note): n, p50, p99, max, min, first (ms)."""
    header = (
        f"{'path':<{width}}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}"
        f"{'min ms':>9}{'first ms':>10}  note"
    )
    print(header)
    print("-" * (len(header) + 30))
    for name, s, note in rows:
        if not s.get("n"):
            print(f"{name:<{width}}{0:>6}  (no samples)  {note}")
            continue
        print(
            f"{name:<{width}}{s['n']:>6}{s['p50_ms']:>10.2f}{s['p99_ms']:>10.2f}"
            f"{s['max_ms']:>10.2f}{s['min_ms']:>9.2f}{s['first_ms']:>10.2f}  {note}"
        )


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def write_json(path: Path | None, doc: dict[str, Any]) -> None:
    """--json PATH: the run's numbers, when asked for."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    say(f"wrote {path}")


@contextlib.contextmanager
def engine_run(prefix: str, keep: bool, work_prefix: str = "sdbench-") -> Iterator[tuple]:
    """A work dir under /tmp and a Docker engine (a private dockerd when none answers) with the
    test images and no container named `prefix`*: (work, engine). Afterwards those containers
    are removed, the engine stopped if this run started it, the work dir removed unless `keep`
    or the run failed.
    """
    work = Path(tempfile.mkdtemp(prefix=work_prefix, dir="/tmp"))
    engine = None
    try:
        say(f"work dir {work}")
        engine = ensure_engine(work / "docker")
        ensure_images(engine.client)
        remove_test_containers(engine.client, prefix)
        yield work, engine
    except BaseException:
        keep = True  # the logs of a failed run are what explains it
        raise
    finally:
        if engine is not None:
            try:
                remove_test_containers(engine.client, prefix)
            finally:
                engine.stop(remove_work_dir=True)
        if keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def engine_environment(engine) -> dict[str, Any]:
    """base_environment() and the Docker engine's (a dockerenv.DockerEngine)."""
    version = engine.client.version()
    info = engine.client.info()
    return {
        **base_environment(),
        "docker_engine": version.get("Version"),
        "docker_api": version.get("ApiVersion"),
        "storage_driver": info.get("Driver"),
        "engine": "private dockerd (started by this run)" if engine.owned else engine.host,
    }


# --- on a Docker engine: the probe, fresh containers, results -------------------------------


class ProbeReader:
    """Reads probe lines as they arrive ("TERM <probe id>") and keeps the host's read time."""

    def __init__(self, directory: Path) -> None:
        self.probe = SignalProbe(directory)
        self._seen: dict[str, float] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probe-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                line = self.probe.read(timeout=0.5)
            except TimeoutError:
                continue
            parts = line.text.split()
            if len(parts) == 2 and parts[0] == "TERM":
                with self._cond:
                    self._seen.setdefault(parts[1], line.wall)
                    self._cond.notify_all()

    def wait(self, probe_id: str, timeout: float = PROBE_TIMEOUT_S) -> float:
        """The host wall time at which `probe_id`'s TERM line was read."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while probe_id not in self._seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no SIGTERM probe line from {probe_id} in {timeout}s")
                self._cond.wait(left)
            return self._seen[probe_id]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.probe.close()


@dataclass
class Workload:
    name: str
    container: Any  # docker.models.containers.Container


class Containers:
    """Fresh `exits_on_term` workloads for one node label, created ahead in batches."""

    def __init__(
        self,
        client: docker.DockerClient,
        probe: ProbeReader,
        node: str,
        batch: int,
        prefix: str = CONTAINER_PREFIX,
    ):
        self.client = client
        self.prefix = prefix
        self.probe = probe
        self.node = node
        self.batch = batch
        self._ready: list[Workload] = []
        self._used: list[Workload] = []
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="create")

    def _create(self, name: str) -> Workload:
        container = self.client.containers.create(
            BASE_IMAGE,
            workload_command("exits_on_term"),
            name=name,
            labels={
                "spotdrain.node": self.node,
                "spotdrain.kind": "batch",
                "spotdrain.test.behaviour": "exits_on_term",
            },
            environment={**self.probe.probe.env, "SPOTDRAIN_PROBE_ID": name},
            mounts=[self.probe.probe.mount],
            network_mode="none",
        )
        return Workload(name, container)

    def _refill(self, count: int) -> None:
        names = [f"{self.prefix}{self.node}-{uuid.uuid4().hex[:10]}" for _ in range(count)]
        self._ready.extend(self._pool.map(self._create, names))

    def fresh(self, remaining: int) -> Workload:
        """A created, never-started container: started now, returned once its trap is set."""
        if not self._ready:
            self._flush()  # remove the last batch outside any measurement
            self._refill(min(self.batch, max(remaining, 1)))
        wl = self._ready.pop(0)
        wl.container.start()
        wait_ready(wl.container, timeout=20)
        self._used.append(wl)
        return wl

    def started_batch(self, count: int) -> list[Workload]:
        """`count` running containers at once (for the scenarios that target one by id)."""
        self._flush()
        self._refill(count)
        batch, self._ready = self._ready, []
        for wl in batch:
            wl.container.start()
        for wl in batch:
            wait_ready(wl.container, timeout=20)
        self._used.extend(batch)
        return batch

    def _flush(self) -> None:
        used, self._used = self._used, []
        for wl in used:
            try:
                self.client.api.remove_container(wl.container.id, force=True)
            except docker.errors.NotFound:
                pass

    def close(self) -> None:
        self._flush()
        for wl in self._ready:
            try:
                self.client.api.remove_container(wl.container.id, force=True)
            except docker.errors.NotFound:
                pass
        self._ready = []
        self._pool.shutdown(wait=True)


def wait_exited(client: docker.DockerClient, wl: Workload, timeout: float = 10.0) -> None:
    client.api.wait(wl.container.id, timeout=timeout)


def settle() -> None:
    """A short random pause between iterations, so the engine's after-exit work is done."""
    time.sleep(random.uniform(0.05, 0.15))


@dataclass
class Result:
    scenario: str
    samples_ms: list[float] = field(default_factory=list)
    phases_ms: dict[str, list[float]] = field(default_factory=dict)  # spotdrain breakdown

    def add_phase(self, name: str, ms: float) -> None:
        self.phases_ms.setdefault(name, []).append(ms)


def run_floor(ctx: Any, runs: int, prefix: str = CONTAINER_PREFIX) -> Result:
    """The floor: a bare Engine API kill (`client.api.kill(id, signal="SIGTERM")`) -> probe
    line, timed from just before the call. `ctx` has .client, .probe, .batch, .progress()."""
    res = Result("floor")
    pool = Containers(ctx.client, ctx.probe, "bench-floor", ctx.batch, prefix)
    try:
        done = 0
        while done < runs:
            for wl in pool.started_batch(min(ctx.batch, runs - done)):
                settle()
                t0 = time.time()
                ctx.client.api.kill(wl.container.id, signal="SIGTERM")
                t1 = ctx.probe.wait(wl.name)
                res.samples_ms.append((t1 - t0) * 1000)
                wait_exited(ctx.client, wl)
                done += 1
                ctx.progress(res, runs)
    finally:
        pool.close()
    return res


def breakdown(
    res: Result, events: list[dict], t_start: float, t_probe: float, start: str = "write"
) -> None:
    """Where the time went, from the agent's own event stamps (all on this host's clock);
    `start` names the instant timed from (t_start: the notice written, the provider's flip)."""
    first = {}
    for ev in events:
        first.setdefault(ev["kind"], ev)
    try:
        t_seen = first["notice_received"]["wall_time"]  # T0: the agent read the notice
        t_taint = first["tainted"]["wall_time"]  # the taint in force (remote answer or local)
        t_kill = first["sigterm_sent"]["wall_time"]  # the kill call returned
    except KeyError:
        return
    res.add_phase(f"{start}->agent T0", (t_seen - t_start) * 1000)
    res.add_phase("T0->tainted", (t_taint - t_seen) * 1000)
    # list this node's containers + the kill call + delivery (compare with the floor)
    res.add_phase("tainted->probe", (t_probe - t_taint) * 1000)
    res.add_phase("tainted->kill returned", (t_kill - t_taint) * 1000)


def print_phases(results: dict[str, Result], names: Any) -> dict[str, dict[str, dict]]:
    """The breakdown of each named result that has one, printed; the summaries by phase."""
    phases: dict[str, dict[str, dict]] = {}
    for name in names:
        r = results.get(name)
        if r is None or not r.phases_ms:
            continue
        print()
        print(f"{name}: where the time goes (agent event stamps; ms)")
        for phase, values in r.phases_ms.items():
            s = summary(values)
            phases.setdefault(name, {})[phase] = s
            print(
                f"  {phase:<24} p50 {s['p50_ms']:8.1f}  p99 {s['p99_ms']:8.1f}"
                f"  max {s['max_ms']:8.1f}"
            )
    return phases
