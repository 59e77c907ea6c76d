"""The coordinator at fleet scale: N simulated agents (mutual TLS, loopback) against the real
`spotdrain-coordinator` process. See tests/bench/README.md ("fleet_scale.py") for what is timed.

    .venv/bin/python tests/bench/fleet_scale.py --quick
    .venv/bin/python tests/bench/fleet_scale.py --nodes 1000 --capacity --flood --mass

The simulated agents live in worker processes (tests/bench/simfleet.py), a few thousand streams
each; this process runs the coordinator, two router watches, the operator's calls and the
measurements. Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import multiprocessing
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import grpc  # noqa: E402
import psutil  # noqa: E402
import simfleet  # noqa: E402
from benchutil import base_environment, percentile  # noqa: E402
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402

from fakes.pki import CertFiles, Pki, _name, _write_key  # noqa: E402
from spotdrain.protocol.limits import MAX_ADMIN_MESSAGE_BYTES  # noqa: E402
from spotdrain.v1 import spotdrain_pb2 as pb  # noqa: E402
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc  # noqa: E402

REPO = HERE.parent.parent
MODEL, IMAGE, SLOTS = "fleet-bench", "bench/fake-model:1", 4
NODES_PER_GROUP = 1000
NODES_PER_SHARD = 2500
COORDINATOR_CPU = 0  # --pin: the coordinator's own core
INFLIGHT_PER_SHARD = 200  # registrations in flight per shard during setup: bounded startup
TAINTS = 50
EVENT_EVERY_S = 3.0
EVENTS_PER_BATCH = 4
BATCHES_PER_TICK = 5  # fleet-wide, every EVENT_EVERY_S
STORM_TIMEOUT_S = 120.0
# The mass reclamation waits for the coordinator to settle after the storm: 1 s samples under
# this many cores (its steady work at 10,000 nodes is 0.4-0.5), at most SETTLE_TIMEOUT_S.
SETTLED_CPU = 0.6
SETTLE_TIMEOUT_S = 60.0
REPLACE_WAIT_S = 60.0
ADMIN_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_ADMIN_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_ADMIN_MESSAGE_BYTES),
]


def progress(text: str) -> None:
    print(f"fleet_scale [{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# --- certificates, made once and cached in the work dir ---------------------------------------


class CachedPki(Pki):
    """tests/fakes/pki.py's Pki over a CA kept on disk, so 10,000 node certificates are made once.
    Certificates live a day (Pki.issue): the cache is thrown away after 20 hours."""

    MAX_AGE_S = 20 * 3600

    def __init__(self, directory: Path) -> None:  # noqa: D107 (no Pki.__init__: it makes a CA)
        self.dir = directory
        self.ca_path = directory / "ca.pem"
        key_path = directory / "ca.key"
        fresh = (
            self.ca_path.exists() and time.time() - self.ca_path.stat().st_mtime < self.MAX_AGE_S
        )
        if not fresh:
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
            self._make_ca(key_path)
        self.ca_key = serialization.load_pem_private_key(key_path.read_bytes(), None)
        self.ca_cert = x509.load_pem_x509_certificate(self.ca_path.read_bytes())

    def _make_ca(self, key_path: Path) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name("spotdrain fleet bench CA"))
            .issuer_name(_name("spotdrain fleet bench CA"))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        _write_key(key, key_path)
        self.ca_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def cached(self, common_name: str, server: bool = False) -> CertFiles:
        stem = common_name.replace(":", "-")
        cert, key = self.dir / f"{stem}.pem", self.dir / f"{stem}.key"
        if cert.exists() and key.exists():
            return CertFiles(str(cert), str(key), str(self.ca_path))
        return self.issue(common_name, server=server)


def node_id(i: int) -> str:
    return f"n{i:05d}"


def node_specs(pki: CachedPki, n: int) -> list[list[str]]:
    specs = []
    for i in range(n):
        if i and i % 1000 == 0:
            progress(f"certificates: {i}/{n}")
        who = pki.cached(f"node:{node_id(i)}")
        specs.append([node_id(i), f"group-{i // NODES_PER_GROUP:02d}", who.cert, who.key])
    return specs


# --- the coordinator process ------------------------------------------------------------------


@dataclass
class CoordinatorProc:
    argv_base: list[str]
    work: Path
    db: str
    server: CertFiles
    level: str
    popen: subprocess.Popen[bytes] | None = None
    address: str = ""
    metrics_url: str = ""
    log_path: Path = field(default_factory=Path)
    spawned_at: float = 0.0
    listening_at: float = 0.0

    def start(self, port: int = 0, timeout: float = 60.0) -> None:
        self.log_path = self.work / f"coordinator-{int(time.time() * 1000)}.log"
        argv = [
            *self.argv_base,
            "--listen",
            f"127.0.0.1:{port}",
            "--db",
            self.db,
            "--metrics-listen",
            "127.0.0.1:0",
            "--tls-cert",
            self.server.cert,
            "--tls-key",
            self.server.key,
            "--client-ca",
            self.server.ca,
            "--log-level",
            self.level,
        ]
        with open(self.log_path, "ab") as log:
            self.spawned_at = time.monotonic()
            # Its own session: a Ctrl-C here reaches only this process, which stops it in order.
            self.popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.work,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        deadline = time.monotonic() + timeout
        while not (m := re.search(r"listening on (\S+)", self.log())):
            if self.popen.poll() is not None:
                raise RuntimeError(f"coordinator exited {self.popen.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"coordinator not listening after {timeout} s")
            time.sleep(0.01)
        self.listening_at = time.monotonic()
        self.address = m.group(1)
        metrics = re.search(r"metrics on (\S+)", self.log())
        self.metrics_url = f"http://{metrics.group(1)}/metrics" if metrics else ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()


# --- the simulator's worker processes ---------------------------------------------------------


class ShardPool:
    """Worker processes, each a simfleet.Shard, driven over pipes from this process's loop."""

    def __init__(self, count: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork under a gRPC runtime
        self.procs, self.conns = [], []
        for _ in range(count):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=simfleet.shard_main, args=(theirs,), daemon=True)
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)
        self.where: dict[str, int] = {}  # node id -> shard
        self._futures: dict[int, asyncio.Future[Any]] = {}
        self._ids = 0
        loop = asyncio.get_running_loop()
        for i, conn in enumerate(self.conns):
            loop.add_reader(conn.fileno(), self._readable, i)

    def _readable(self, i: int) -> None:
        try:
            req_id, status, result = self.conns[i].recv()
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self.conns[i].fileno())
            for fut in self._futures.values():
                if not fut.done():
                    fut.set_exception(RuntimeError(f"simulator shard {i} died"))
            return
        fut = self._futures.pop(req_id)
        if status == "ok":
            fut.set_result(result)
        else:
            fut.set_exception(RuntimeError(f"simulator shard {i}: {result}"))

    async def call(self, i: int, cmd: str, **kwargs: Any) -> Any:
        self._ids += 1
        fut = self._futures[self._ids] = asyncio.get_running_loop().create_future()
        self.conns[i].send((self._ids, cmd, kwargs))
        return await fut

    async def all(self, cmd: str, **kwargs: Any) -> list[Any]:
        return list(await asyncio.gather(*(self.call(i, cmd, **kwargs) for i in self.range)))

    @property
    def range(self) -> range:
        return range(len(self.conns))

    def cpu_s(self) -> float:
        total = 0.0
        for proc in self.procs:
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(proc.pid).cpu_times()
                total += t.user + t.system
        return total

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(15):
                await self.all("stop")
        loop = asyncio.get_running_loop()
        for conn in self.conns:
            with contextlib.suppress(Exception):
                loop.remove_reader(conn.fileno())
                conn.close()
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


# --- routers, the operator, measurements ------------------------------------------------------


def secure(address: str, who: CertFiles, options: list | None = None) -> grpc.aio.Channel:
    creds = grpc.ssl_channel_credentials(
        Path(who.ca).read_bytes(), Path(who.key).read_bytes(), Path(who.cert).read_bytes()
    )
    return grpc.aio.secure_channel(address, creds, options=options or ADMIN_OPTIONS)


class RouterWatch:
    """A router on Routes.WatchRoutes: the routed workers and when each was first removed."""

    def __init__(self, address: str, who: CertFiles) -> None:
        self.channel = secure(address, who)
        self.routes: set[str] = set()
        self.removed_at: dict[str, float] = {}
        self.error = ""
        self.task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        call = pb_grpc.RoutesStub(self.channel).WatchRoutes(pb.WatchRoutesRequest(model=MODEL))
        try:
            async for update in call:
                now = time.monotonic()
                if update.snapshot:
                    self.routes = {r.worker_id for r in update.upsert}
                else:
                    self.routes.update(r.worker_id for r in update.upsert)
                for worker_id in update.removed:
                    self.routes.discard(worker_id)
                    self.removed_at.setdefault(worker_id, now)
        except grpc.aio.AioRpcError as e:
            self.error = e.code().name

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.channel.close()


class CpuSampler:
    """A process's CPU once a second, in a thread (no awaits between samples to skew them)."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(psutil.Error):
                t = self.proc.cpu_times()
                self.samples.append((time.monotonic(), t.user + t.system))
            self._stop.wait(1.0)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        rss = 0.0
        with contextlib.suppress(psutil.Error):
            rss = self.proc.memory_info().rss / 2**20
        s = self.samples
        if len(s) < 2:
            return {"rss_mib": rss}
        steps = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(s, s[1:], strict=False)]
        return {
            "cpu_avg": (s[-1][1] - s[0][1]) / (s[-1][0] - s[0][0]),
            "cpu_peak_1s": max(steps),
            "rss_mib": rss,
        }


def process_cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def scrape(url: str) -> str:
    if not url:
        return ""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""


def gauge(text: str, name: str) -> float | None:
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return max(values) if values else None


def buckets(text: str, name: str) -> dict[float, float]:
    out: dict[float, float] = {}
    for m in re.finditer(rf'^{name}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$', text, re.M):
        le = math.inf if m.group(1) == "+Inf" else float(m.group(1))
        out[le] = out.get(le, 0.0) + float(m.group(2))
    return out


def histogram_quantile(before: dict[float, float], after: dict[float, float], q: float):
    """Prometheus' histogram_quantile over the window (after - before), seconds; None if the
    histogram is absent or empty."""
    if not after:
        return None
    edges = sorted(after)
    counts = [after[e] - before.get(e, 0.0) for e in edges]
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for edge, cum in zip(edges, counts, strict=True):
        if cum >= rank:
            if math.isinf(edge):
                return lower  # above the last finite bucket: its bound, a floor
            return lower + (edge - lower) * (rank - below) / max(cum - below, 1e-12)
        lower, below = edge, cum
    return lower


LAG = "spotdrain_event_loop_lag_seconds"
GC_MAX = "spotdrain_gc_pause_max_seconds"
TAINT_ANSWER = "spotdrain_taint_answer_seconds"
GC_PAUSES = "spotdrain_gc_pause_seconds"
GC_TARGET_S = 0.05


def window_pauses(before: dict[float, float], after: dict[float, float]) -> dict[str, Any]:
    """The window's garbage collections from the pause histogram (after - before): how many
    stopped the process longer than GC_TARGET_S, and the bucket bound of the longest (a
    ceiling, seconds; inf past the last bucket). The gauge of the longest pause counts since
    the coordinator started, setup and registration included."""
    edges = sorted(after)
    counts = {e: after[e] - before.get(e, 0.0) for e in edges}
    total = counts[edges[-1]] if edges else 0.0
    within = max((c for e, c in counts.items() if e <= GC_TARGET_S), default=0.0)
    longest = next((e for e in edges if counts[e] >= total), None) if total else None
    return {"over_target": total - within, "longest_le_s": longest, "n": total}


# --- the store's size -------------------------------------------------------------------------


@dataclass
class Backend:
    name: str
    pg: Any = None  # a tests/fakes/pgserver.py PgServer

    def new_db(self, work: Path, label: str) -> str:
        if self.pg is None:
            return str(work / "coordinator.sqlite")
        return self.pg.create_database(re.sub(r"[^a-z0-9_]", "_", f"fleet_{label}".lower()))

    def size_bytes(self, db: str) -> float:
        if self.pg is None:
            return sum(os.path.getsize(p) for p in (db, db + "-wal") if os.path.exists(p))
        try:
            with self.pg.connect(db.rsplit("/", 1)[1]) as conn:
                return float(
                    conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]
                )
        except Exception:
            return float("nan")


# --- one run: a size, a backend, a variant ----------------------------------------------------


def ms_summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50_ms": percentile(values, 0.5),
        "p99_ms": percentile(values, 0.99),
        "max_ms": max(values),
    }


def taint_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    s = ms_summary([r["ms"] for r in results])
    s["over_800ms"] = sum(1 for r in results if r["ms"] > 800 or r["code"] != "OK")
    s["codes"] = dict(sorted({r["code"]: 0 for r in results}.items()))
    for r in results:
        s["codes"][r["code"]] += 1
    return s


class Run:
    def __init__(
        self,
        opts: argparse.Namespace,
        pki: CachedPki,
        backend: Backend,
        n: int,
        variant: str,
        label: str,
    ) -> None:
        self.opts, self.pki, self.backend, self.n, self.variant = opts, pki, backend, n, variant
        self.work = opts.work / "runs" / label
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.result: dict[str, Any] = {"nodes": n, "backend": backend.name, "variant": variant}
        self.coord: CoordinatorProc | None = None
        self.shards: ShardPool | None = None
        self.routers: list[RouterWatch] = []
        self.admin_channel: grpc.aio.Channel | None = None
        self.tainted: set[str] = set()
        self.label = label

    # --- setup ----------------------------------------------------------------------------

    async def start(self) -> None:
        db = self.backend.new_db(self.work, self.label)
        pin = ["taskset", "-c", str(COORDINATOR_CPU)] if self.opts.pin else []
        self.coord = CoordinatorProc(
            [*pin, *shlex.split(self.opts.coordinator_cmd)],
            self.work,
            db,
            self.pki.cached("coordinator", server=True),
            self.opts.coordinator_log_level,
        )
        self.coord.start()
        if self.backend.pg is not None and any(self.work.glob("postgresql*")):
            raise RuntimeError("this coordinator took --db postgresql://... for a file name")
        progress(f"{self.label}: coordinator pid {self.coord.pid} on {self.coord.address}")
        operator = self.pki.cached("operator:fleet-bench")
        self.admin_channel = secure(self.coord.address, operator)
        self.admin = pb_grpc.AdminStub(self.admin_channel)

    async def connect_nodes(self, specs: list[list[str]]) -> None:
        assert self.coord is not None
        count = max(1, min(4, math.ceil(len(specs) / NODES_PER_SHARD)))
        self.shards = ShardPool(count)
        t0 = time.monotonic()
        for i in self.shards.range:
            part = specs[i::count]
            for spec in part:
                self.shards.where[spec[0]] = i
            await self.shards.call(
                i,
                "connect",
                address=self.coord.address,
                ca=self.pki.ca_path.as_posix(),
                specs=part,
                inflight=INFLIGHT_PER_SHARD,
            )
        await self._until_registered(0.0, 0.0, self.opts.setup_timeout_s, "registering")
        self.result["register_s"] = time.monotonic() - t0

    async def _until_registered(
        self, since: float, failed_after: float, timeout: float, what: str
    ) -> list[dict[str, Any]]:
        assert self.shards is not None
        deadline = time.monotonic() + timeout
        last_said = 0.0
        while True:
            stats = await self.shards.all("stats", since=since, failed_after=failed_after)
            done = sum(s["registered_since" if since else "registered"] for s in stats)
            if done >= self.n:
                return stats
            if time.monotonic() - last_said > 2:
                progress(f"{self.label}: {what}: {done}/{self.n}")
                last_said = time.monotonic()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {done}/{self.n} after {timeout:.0f} s")
            await asyncio.sleep(0.2)

    async def place_workers(self) -> bool:
        assert self.coord is not None
        for name in ("router:fleet-bench-a", "router:fleet-bench-b"):
            self.routers.append(RouterWatch(self.coord.address, self.pki.cached(name)))
        t0 = time.monotonic()
        if self.variant == "capacity":
            placing = asyncio.ensure_future(
                self.admin.SetModelReplicas(
                    pb.SetModelReplicasRequest(
                        model=MODEL, replicas=self.n, image=IMAGE, slots=SLOTS
                    ),
                    timeout=self.opts.place_timeout_s,
                )
            )
        else:
            placing = asyncio.ensure_future(self._start_each())
        ok = await self._until_routed(t0, self.opts.place_timeout_s)
        self.result["place_s"] = time.monotonic() - t0 if ok else None
        self.result["placed"] = min(len(r.routes) for r in self.routers)
        if not ok:
            placing.cancel()
        await asyncio.gather(placing, return_exceptions=True)
        return ok

    async def _start_each(self) -> None:
        """No desired count: one Admin.StartWorker per node, through the same gate."""
        gate = asyncio.Semaphore(16)

        async def one(node: str) -> None:
            async with gate:
                await self.admin.StartWorker(
                    pb.StartWorkerRequest(node_id=node, model=MODEL, image=IMAGE, slots=SLOTS),
                    timeout=60,
                )

        await asyncio.gather(*(one(node_id(i)) for i in range(self.n)))

    async def _until_routed(self, t0: float, timeout: float) -> bool:
        last_said = time.monotonic()
        while min(len(r.routes) for r in self.routers) < self.n:
            if time.monotonic() - t0 > timeout:
                progress(f"{self.label}: placing: gave up after {timeout:.0f} s")
                return False
            if time.monotonic() - last_said > 2:
                seen = min(len(r.routes) for r in self.routers)
                progress(f"{self.label}: placing: {seen}/{self.n} routed")
                last_said = time.monotonic()
            await asyncio.sleep(0.05)
        return True

    # --- taints ---------------------------------------------------------------------------

    def pick_nodes(self, k: int) -> list[str]:
        """Nodes never tainted before, the flood's node left out."""
        free = [node_id(i) for i in range(1, self.n) if node_id(i) not in self.tainted]
        chosen = random.sample(free, min(k, len(free)))
        self.tainted.update(chosen)
        return chosen

    async def taints(self, nodes: list[str], start: float, spread_s: float) -> list[dict]:
        """Each node's Taint at a random moment in [start, start + spread_s)."""
        assert self.shards is not None
        per: dict[int, list[tuple[str, float, str]]] = {}
        for node in nodes:
            at = start + random.uniform(0, spread_s)
            item = (node, at, f"bench-{node}-{int(at * 1000)}")
            per.setdefault(self.shards.where[node], []).append(item)
        parts = await asyncio.gather(
            *(self.shards.call(i, "taints", items=v) for i, v in per.items())
        )
        return [r for part in parts for r in part]

    async def drain_to_watch(self, results: list[dict]) -> dict[str, Any]:
        """From each Taint's start to both routers having removed that node's workers."""
        wanted = [(r, w) for r in results if r["code"] == "OK" for w in r["workers"]]
        deadline = time.monotonic() + 5.0
        # Polled: the watches stamp each removal themselves, this only bounds the wait.
        while time.monotonic() < deadline and not all(  # noqa: ASYNC110
            w in rt.removed_at for _r, w in wanted for rt in self.routers
        ):
            await asyncio.sleep(0.05)
        by_taint: dict[int, float] = {}
        missing = 0
        for r, w in wanted:
            seen = [rt.removed_at.get(w) for rt in self.routers]
            if None in seen:
                missing += 1
                continue
            key = id(r)
            by_taint[key] = max(by_taint.get(key, 0.0), (max(seen) - r["t0"]) * 1000)
        s = ms_summary(list(by_taint.values()))
        s["missing"] = missing
        return s

    async def replacements(self, nodes: list[str], since: float) -> dict[str, Any]:
        """start_worker commands received since `since` by nodes other than `nodes`."""
        assert self.shards is not None
        expected = len(nodes)
        skip = set(nodes)
        deadline = time.monotonic() + REPLACE_WAIT_S
        while True:
            got = [s for part in await self.shards.all("starts_since", since=since) for s in part]
            got = [s for s in got if s[1] not in skip]
            if len(got) >= expected or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        last = max((s[0] for s in got), default=since)
        return {"expected": expected, "placed": len(got), "last_s": last - since}

    # --- phases ---------------------------------------------------------------------------

    def _store_size(self) -> float:
        assert self.coord is not None
        return self.backend.size_bytes(self.coord.db)

    async def steady(self, flood: bool) -> dict[str, Any]:
        """Heartbeats (always on), two watches, TAINTS Taints and event batches over the
        window; with `flood`, one node floods the largest batches all the while."""
        assert self.coord is not None and self.shards is not None
        window = self.opts.window_s
        phase = "flood" if flood else "steady"
        progress(f"{self.label}: {phase} window, {window:.0f} s")
        metrics0, size0 = (
            await asyncio.to_thread(scrape, self.coord.metrics_url),
            self._store_size(),
        )
        sampler, sim0, t0 = CpuSampler(self.coord.pid), self._sim_cpu(), time.monotonic()
        nodes = self.pick_nodes(self.opts.taints)
        ticks = max(1, round(BATCHES_PER_TICK / len(self.shards.range)))
        work = [
            self.taints(nodes, t0 + 1.0, max(0.0, window - 3.0)),
            self.shards.all(
                "events",
                duration=window - 2.0,
                every=EVENT_EVERY_S,
                per_tick=ticks,
                size=EVENTS_PER_BATCH,
            ),
        ]
        if flood:
            work.append(self.shards.call(0, "flood", node_id=node_id(0), duration=window))
        done = await asyncio.gather(*work)
        wall = time.monotonic() - t0
        cpu = sampler.stop()
        metrics1, size1 = (
            await asyncio.to_thread(scrape, self.coord.metrics_url),
            self._store_size(),
        )
        out: dict[str, Any] = {"taint": taint_summary(done[0])}
        out["drain_to_watch"] = await self.drain_to_watch(done[0])
        out["event_ack"] = ms_summary([ms for part in done[1] for ms in part["ack_ms"]])
        out["event_ack"]["unacked"] = sum(part["unacked"] for part in done[1])
        out.update(cpu)
        out["sim_cpu_avg"] = (self._sim_cpu() - sim0) / wall
        out["store_mib_per_min"] = (size1 - size0) / 2**20 / wall * 60
        out["gc_pause_max_s"] = gauge(metrics1, GC_MAX)
        out["gc_window"] = window_pauses(buckets(metrics0, GC_PAUSES), buckets(metrics1, GC_PAUSES))
        out["loop_lag_p99_s"] = histogram_quantile(
            buckets(metrics0, LAG), buckets(metrics1, LAG), 0.99
        )
        out["metrics_scraped"] = bool(metrics1)
        if flood:
            f = done[2]
            out["flood"] = {
                "batches": f["batches"],
                "acked": f["acked"],
                "errors": f["errors"],
                "ack": ms_summary(f["ack_ms"]),
            }
        if self.variant == "capacity":
            out["replacements"] = await self.replacements(nodes, t0)
        return out

    def _sim_cpu(self) -> float:
        assert self.shards is not None
        own = os.times()
        return self.shards.cpu_s() + own.user + own.system

    async def storm(self) -> dict[str, Any]:
        """SIGKILL the coordinator, start it again on the same port and store, and time until
        every agent is registered again."""
        assert self.coord is not None and self.shards is not None
        progress(f"{self.label}: reconnect storm")
        for router in self.routers:
            await router.close()
        self.routers = []
        port = int(self.coord.address.rsplit(":", 1)[1])
        sim0, killed = self._sim_cpu(), time.monotonic()
        self.coord.kill()
        self.coord.start(port=port)
        spawned, listening = self.coord.spawned_at, self.coord.listening_at
        try:
            stats = await self._until_registered(
                killed, listening, STORM_TIMEOUT_S, "re-registering"
            )
            ok = True
        except TimeoutError as e:
            progress(f"{self.label}: {e}")
            stats = await self.shards.all("stats", since=killed, failed_after=listening)
            ok = False
        codes: dict[str, int] = {}
        for s in stats:
            for code, k in s["failed_since"].items():
                codes[code] = codes.get(code, 0) + k
        last = max(s["last_registered"] for s in stats)
        wall = time.monotonic() - killed
        return {
            # The restarted coordinator's CPU since its start, and the simulator's, per second
            # of the storm: which of them the two cores were busy with.
            "cpu_avg": process_cpu_s(self.coord.pid) / wall,
            "sim_cpu_avg": (self._sim_cpu() - sim0) / wall,
            "all_registered": ok,
            "registered": sum(s["registered_since"] for s in stats),
            "restart_to_all_s": last - spawned if ok else None,
            "kill_to_all_s": last - killed if ok else None,
            "coordinator_start_s": listening - spawned,
            "ended_before_registered": sum(
                k for code, k in codes.items() if not code.endswith(":no-connection")
            ),
            "no_connection": sum(k for code, k in codes.items() if code.endswith(":no-connection")),
            "ended_codes": codes,
        }

    async def settle(self) -> float:
        """Wait until the coordinator is back to its steady work (the storm's reconciling done:
        two 1 s samples under SETTLED_CPU cores): a mass reclamation measured in a restart's
        aftermath measures the restart. The seconds it took (the timeout: not settled)."""
        assert self.coord is not None
        proc = psutil.Process(self.coord.pid)
        started = time.monotonic()
        quiet = 0
        last = proc.cpu_times()
        while quiet < 2 and time.monotonic() - started < SETTLE_TIMEOUT_S:
            await asyncio.sleep(1.0)
            now = proc.cpu_times()
            used = (now.user + now.system) - (last.user + last.system)
            quiet = quiet + 1 if used < SETTLED_CPU else 0
            last = now
        return time.monotonic() - started

    async def mass(self) -> dict[str, Any]:
        k = min(self.opts.mass_nodes, max(1, self.n // 2))
        settled_s = await self.settle()
        progress(
            f"{self.label}: settled after {settled_s:.0f} s; "
            f"mass reclamation, {k} Taints within 1 s"
        )
        nodes = self.pick_nodes(k)
        m0 = await asyncio.to_thread(scrape, self.coord.metrics_url)
        cpu0, sim0, t0 = process_cpu_s(self.coord.pid), self._sim_cpu(), time.monotonic()
        lag = asyncio.ensure_future(self.shards.all("lag", duration=2.0))
        results = await self.taints(nodes, t0 + 0.5, 1.0)
        sim_lags = [x for part in await lag for x in part]
        # Who had the two cores while the Taints were answered: the coordinator, or the
        # simulator standing in for the 10,000 hosts (its own cores, in a real fleet).
        wall = time.monotonic() - t0
        cpu1, sim1 = process_cpu_s(self.coord.pid), self._sim_cpu()
        m1 = await asyncio.to_thread(scrape, self.coord.metrics_url)
        out: dict[str, Any] = {"taint": taint_summary(results), "settled_s": settled_s}
        # Each call's start as wall time (the shards' monotonic clock is this machine's), to
        # line up with the coordinator's log when asking where a round trip's time went.
        wall_minus_mono = time.time() - time.monotonic()
        out["calls"] = [
            {
                "node": r["node"],
                "start": r["t0"] + wall_minus_mono,
                "ms": r["ms"],
                "code": r["code"],
            }
            for r in results
        ]
        out["cpu_avg"] = (cpu1 - cpu0) / wall
        out["sim_cpu_avg"] = (sim1 - sim0) / wall
        # Each side's event-loop lag over the burst: a Taint's round trip is as late as the
        # later of the two loops makes it.
        out["sim_lag_p99_ms"] = percentile(sim_lags, 0.99) if sim_lags else None
        lag_s = histogram_quantile(buckets(m0, LAG), buckets(m1, LAG), 0.99)
        out["lag_p99_ms"] = None if lag_s is None else lag_s * 1000
        # The coordinator's own share (handler start to answer): the rest of each round trip
        # is gRPC's queue before the handler, the network and the simulator.
        handled = buckets(m0, TAINT_ANSWER), buckets(m1, TAINT_ANSWER)
        for q in (0.5, 0.99):
            seconds = histogram_quantile(*handled, q)
            out[f"handled_p{int(q * 100)}_ms"] = None if seconds is None else seconds * 1000
        if self.variant == "capacity":
            with_workers = [r["node"] for r in results if r["workers"]]
            out["replacements"] = await self.replacements(with_workers, t0)
        return out

    async def close(self) -> None:
        for router in self.routers:
            await router.close()
        if self.shards is not None:
            await self.shards.close()
        if self.admin_channel is not None:
            await self.admin_channel.close()
        if self.coord is not None:
            self.coord.stop()


async def run_size(
    opts: argparse.Namespace,
    pki: CachedPki,
    backend: Backend,
    n: int,
    variant: str,
    specs: list[list[str]],
    biggest: bool,
) -> dict[str, Any]:
    label = f"{backend.name}-{n}-{variant}"
    run = Run(opts, pki, backend, n, variant, label)
    try:
        await run.start()
        await run.connect_nodes(specs[:n])
        progress(f"{label}: {n} nodes registered in {run.result['register_s']:.1f} s")
        if not await run.place_workers():
            run.result["error"] = f"placing: {run.result['placed']}/{n} after the timeout"
            return run.result
        progress(f"{label}: {n} workers placed in {run.result['place_s']:.1f} s")
        if not opts.mass_only:
            run.result["steady"] = await run.steady(flood=False)
            if opts.flood:
                run.result["flood"] = await run.steady(flood=True)
            run.result["storm"] = await run.storm()
        if opts.mass and biggest:
            run.result["mass"] = await run.mass()
    except (TimeoutError, RuntimeError, grpc.aio.AioRpcError) as e:
        run.result["error"] = f"{type(e).__name__}: {e}"
        progress(f"{label}: stopped: {run.result['error']}")
    finally:
        await run.close()
    return run.result


async def baseline(
    opts: argparse.Namespace, pki: CachedPki, backend: Backend, specs: list[list[str]]
) -> dict[str, Any]:
    """The idle coordinator (no nodes): CPU and loop lag; then Taints from one node."""
    label = f"{backend.name}-baseline"
    run = Run(opts, pki, backend, 1, "baseline", label)
    try:
        await run.start()
        assert run.coord is not None
        idle_s = min(opts.window_s, 10.0)
        progress(f"{label}: idle coordinator, {idle_s:.0f} s")
        m0 = await asyncio.to_thread(scrape, run.coord.metrics_url)
        sampler = CpuSampler(run.coord.pid)
        await asyncio.sleep(idle_s)
        out: dict[str, Any] = sampler.stop()
        m1 = await asyncio.to_thread(scrape, run.coord.metrics_url)
        out["gc_pause_max_s"] = gauge(m1, GC_MAX)
        out["loop_lag_p99_s"] = histogram_quantile(buckets(m0, LAG), buckets(m1, LAG), 0.99)
        await run.connect_nodes(specs[:1])
        results = []
        for i in range(opts.taints):  # one at a time: the floor, nothing queued behind
            results += await run.taints([node_id(0)], time.monotonic(), 0.0)
            await asyncio.sleep(0.05 + 0.0 * i)
        out["taint"] = taint_summary(results)
        run.result.update(out)
    except (TimeoutError, RuntimeError, grpc.aio.AioRpcError) as e:
        run.result["error"] = f"{type(e).__name__}: {e}"
    finally:
        await run.close()
    return run.result


# --- the report -------------------------------------------------------------------------------


def fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int | float):
        return f"{value * scale:.{digits}f}"
    return str(value)


def dig(doc: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        if not isinstance(doc, dict) or key not in doc:
            return None
        doc = doc[key]
    return doc


# (label, path in a run's result, path in the baseline, scale, digits, target)
ROWS = [
    ("nodes registered (s)", "register_s", None, 1, 1, ""),
    ("placing N workers (s)", "place_s", None, 1, 1, "< 10 (capacity, 10k)"),
    ("Taint p50 (ms)", "steady.taint.p50_ms", "taint.p50_ms", 1, 1, ""),
    ("Taint p99 (ms)", "steady.taint.p99_ms", "taint.p99_ms", 1, 1, "<= 50"),
    ("Taint max (ms)", "steady.taint.max_ms", "taint.max_ms", 1, 1, ""),
    ("Taints > 800 ms / DEADLINE", "steady.taint.over_800ms", "taint.over_800ms", 1, 0, "0"),
    ("drain -> both watches p99 (ms)", "steady.drain_to_watch.p99_ms", None, 1, 1, "<= 50"),
    ("drain -> watches missing", "steady.drain_to_watch.missing", None, 1, 0, "0"),
    ("EventBatch ack p99 (ms)", "steady.event_ack.p99_ms", None, 1, 1, ""),
    ("EventBatch acks (n)", "steady.event_ack.n", None, 1, 0, ""),
    ("coordinator CPU avg (cores)", "steady.cpu_avg", "cpu_avg", 1, 2, "< 1"),
    ("coordinator CPU peak 1 s (cores)", "steady.cpu_peak_1s", "cpu_peak_1s", 1, 2, ""),
    ("coordinator RSS (MiB)", "steady.rss_mib", "rss_mib", 1, 0, ""),
    ("store growth (MiB/min)", "steady.store_mib_per_min", None, 1, 2, ""),
    ("GC pause max since start (ms)", "steady.gc_pause_max_s", "gc_pause_max_s", 1000, 1, ""),
    ("GC: window's longest, bucket (ms)", "steady.gc_window.longest_le_s", None, 1000, 0, "<= 50"),
    ("GC: window's pauses > 50 ms", "steady.gc_window.over_target", None, 1, 0, "0"),
    ("event loop lag p99 (ms)", "steady.loop_lag_p99_s", "loop_lag_p99_s", 1000, 1, ""),
    ("simulator CPU avg (cores)", "steady.sim_cpu_avg", None, 1, 2, ""),
    ("replacements placed (steady)", "steady.replacements.placed", None, 1, 0, "= Taints"),
    ("flood: others' Taint p99 (ms)", "flood.taint.p99_ms", None, 1, 1, "+<= 10 vs steady"),
    ("flood: batches acked", "flood.flood.acked", None, 1, 0, ""),
    ("flood: batch ack p99 (ms)", "flood.flood.ack.p99_ms", None, 1, 1, ""),
    ("storm: restart -> all registered (s)", "storm.restart_to_all_s", None, 1, 2, "< 15"),
    ("storm: coordinator start (s)", "storm.coordinator_start_s", None, 1, 2, ""),
    ("storm: ended before Registered", "storm.ended_before_registered", None, 1, 0, "0"),
    ("storm: attempts with no connection", "storm.no_connection", None, 1, 0, ""),
    ("storm: coordinator CPU (cores)", "storm.cpu_avg", None, 1, 2, ""),
    ("storm: simulator CPU (cores)", "storm.sim_cpu_avg", None, 1, 2, ""),
    ("mass: after the storm, settled (s)", "mass.settled_s", None, 1, 0, ""),
    ("mass: Taints (n)", "mass.taint.n", None, 1, 0, ""),
    ("mass: Taint p99 (ms)", "mass.taint.p99_ms", None, 1, 1, "<= 200"),
    ("mass: Taint max (ms)", "mass.taint.max_ms", None, 1, 1, "<= 800"),
    ("mass: in the coordinator p50 (ms)", "mass.handled_p50_ms", None, 1, 1, ""),
    ("mass: in the coordinator p99 (ms)", "mass.handled_p99_ms", None, 1, 1, ""),
    ("mass: > 800 ms / DEADLINE", "mass.taint.over_800ms", None, 1, 0, "0"),
    ("mass: coordinator CPU (cores)", "mass.cpu_avg", None, 1, 2, ""),
    ("mass: simulator CPU (cores)", "mass.sim_cpu_avg", None, 1, 2, ""),
    ("mass: coordinator loop lag p99 (ms)", "mass.lag_p99_ms", None, 1, 1, ""),
    ("mass: simulator loop lag p99 (ms)", "mass.sim_lag_p99_ms", None, 1, 1, ""),
    ("mass: replacements placed", "mass.replacements.placed", None, 1, 0, "= Taints"),
]


def print_tables(report: dict[str, Any]) -> None:
    for backend, by_variant in report["runs"].items():
        base = report["baseline"].get(backend, {})
        for variant, runs in by_variant.items():
            how = "SetModelReplicas" if variant == "capacity" else "Admin.StartWorker per node"
            print(f"\n== {backend}, {variant} (workers placed by {how})")
            heads = [f"N={r['nodes']}" for r in runs]
            print(f"{'':38}{'baseline':>10}" + "".join(f"{h:>12}" for h in heads) + "  target")
            for label, path, bpath, scale, digits, target in ROWS:
                values = [dig(r, path) for r in runs]
                if all(v is None for v in values) and (bpath is None or dig(base, bpath) is None):
                    continue
                b = fmt(dig(base, bpath), scale, digits) if bpath else ""
                cells = "".join(f"{fmt(v, scale, digits):>12}" for v in values)
                print(f"{label:38}{b:>10}{cells}  {target}")
            for r in runs:
                if "error" in r:
                    print(f"  N={r['nodes']}: {r['error']}")
                codes = dig(r, "steady.taint.codes") or {}
                if set(codes) - {"OK"}:
                    print(f"  N={r['nodes']}: steady Taint codes {codes}")
                storm_codes = dig(r, "storm.ended_codes")
                if storm_codes:
                    print(f"  N={r['nodes']}: storm: streams ended before Registered {storm_codes}")
        if "error" in base:
            print(f"  baseline: {base['error']}")


# --- main -------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", default="1000,5000,10000", help="sizes, comma separated")
    p.add_argument("--backend", choices=("sqlite", "postgresql", "both"), default="sqlite")
    p.add_argument(
        "--capacity",
        action="store_true",
        help="also the variant with desired capacity kept (SetModelReplicas)",
    )
    p.add_argument(
        "--capacity-only",
        action="store_true",
        help="only the variant with desired capacity kept (no one-StartWorker-per-node run)",
    )
    p.add_argument("--flood", action="store_true", help="also a window with one node flooding")
    p.add_argument("--mass", action="store_true", help="mass reclamation on the largest size")
    p.add_argument("--mass-nodes", type=int, default=1000)
    p.add_argument(
        "--mass-only",
        action="store_true",
        help="only the mass reclamation once the workers are placed (a quick look)",
    )
    p.add_argument("--window-s", type=float, default=60.0)
    p.add_argument("--taints", type=int, default=TAINTS, help="Taint callers per window")
    p.add_argument("--quick", action="store_true", help="small sizes and a short window")
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument(
        "--coordinator-cmd",
        default=str(REPO / ".venv/bin/spotdrain-coordinator"),
        help="the coordinator's command (shell words), e.g. to run another checkout",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help=f"the coordinator alone on CPU {COORDINATOR_CPU}, everything else (the simulator, "
        "PostgreSQL, this script) on the others: the coordinator measured on a core of its own",
    )
    p.add_argument("--coordinator-log-level", default="INFO")
    p.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/spotdrain-fleet-scale"),
        help="certificates are cached here; runs/ holds the logs and stores",
    )
    p.add_argument("--setup-timeout-s", type=float, default=300.0)
    p.add_argument("--place-timeout-s", type=float, default=300.0)
    opts = p.parse_args(argv)
    opts.mass = opts.mass or opts.mass_only
    if opts.quick:
        opts.nodes = "100,300"
        opts.window_s = min(opts.window_s, 20.0)
        opts.taints = min(opts.taints, 20)
        opts.mass_nodes = min(opts.mass_nodes, 100)
    opts.sizes = sorted({int(x) for x in opts.nodes.split(",") if x.strip()})
    if opts.window_s < 10:
        p.error("--window-s must be at least 10")
    return opts


def backends(opts: argparse.Namespace) -> list[Backend]:
    out = []
    if opts.backend in ("sqlite", "both"):
        out.append(Backend("sqlite"))
    if opts.backend in ("postgresql", "both"):
        try:
            from fakes import pgserver  # noqa: PLC0415 (another engineer's module, may be missing)
        except ImportError:
            print("postgresql: tests/fakes/pgserver.py missing", flush=True)
            return out
        try:
            out.append(Backend("postgresql", pgserver.start_postgres(opts.work)))
        except Exception as e:  # no server binaries, no postgres user: say so and go on
            print(f"postgresql: cannot start a server: {e}", flush=True)
    return out


async def amain(opts: argparse.Namespace) -> dict[str, Any]:
    opts.work.mkdir(parents=True, exist_ok=True)
    progress(f"certificates in {opts.work / 'certs'}")
    pki = CachedPki(opts.work / "certs")
    specs = await asyncio.to_thread(node_specs, pki, max(opts.sizes))
    report: dict[str, Any] = {
        "environment": base_environment(),
        "options": {k: str(v) for k, v in vars(opts).items()},
        "baseline": {},
        "runs": {},
    }
    variants = ["plain", "capacity"] if opts.capacity else ["plain"]
    if opts.capacity_only:
        variants = ["capacity"]
    chosen = backends(opts)
    try:
        for backend in chosen:
            report["baseline"][backend.name] = await baseline(opts, pki, backend, specs)
            for variant in variants:
                runs = report["runs"].setdefault(backend.name, {}).setdefault(variant, [])
                for n in opts.sizes:
                    biggest = n == opts.sizes[-1]
                    runs.append(await run_size(opts, pki, backend, n, variant, specs, biggest))
    finally:
        for backend in chosen:
            if backend.pg is not None:
                backend.pg.stop()
    return report


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    if opts.pin:
        # Inherited by the simulator's shards and PostgreSQL, started from here.
        others = os.sched_getaffinity(0) - {COORDINATOR_CPU}
        if not others:
            print("--pin needs at least two CPUs", file=sys.stderr)
            return 2
        os.sched_setaffinity(0, others)
    started = time.monotonic()
    # A SIGTERM unwinds like Ctrl-C, so every process this started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        report = asyncio.run(amain(opts))
    except KeyboardInterrupt:
        progress("interrupted; everything it started is stopped")
        return 130
    report["wall_s"] = time.monotonic() - started
    env = report["environment"]
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    print(
        f"coordinator: {opts.coordinator_cmd}; mutual TLS, loopback; window {opts.window_s:.0f} s"
        + (f"; pinned alone to CPU {COORDINATOR_CPU}" if opts.pin else "")
    )
    print_tables(report)
    print(f"\nwall time {report['wall_s']:.0f} s")
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
