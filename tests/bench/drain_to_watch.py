"""Benchmark: a worker marked draining -> a router's WatchRoutes stream sees it removed.

Run on demand (pytest does not collect this file; it has no test functions):

    .venv/bin/python tests/bench/drain_to_watch.py [--runs 500] [--nodes 4]
        [--workers-per-node 4] [--watchers 4] [--insecure] [--json PATH]

docs/design.md "Performance targets": worker marked draining to a router's watch seeing it,
p99 <= 20 ms on loopback (anchor: Consul, < 1 s to 172k instances).

What runs: a real `spotdrain-coordinator` process (mutual TLS from tests/fakes/pki.py by default;
`--insecure` for plaintext). Everything else is in this process, on one asyncio loop:

  fake nodes   `--nodes` agents, each on its own channel with its `node:<id>` certificate, on a
               real `AgentLink.Connect` stream. They answer every start_worker with
               WorkerReport(state="started", gate_address=...) at once (no gate behind it: the
               coordinator never dials gates) and note every drain_worker.
  watchers     `--watchers` routers, each its own channel with a `router:` certificate and one
               `Routes.WatchRoutes` stream for the model, stamping each RouteUpdate with
               time.perf_counter() as the `async for` hands it over.
  operator     places `--workers-per-node` workers on every node (Admin.StartWorker).

One run, on the nodes in turn: the node's owner pauses, as the agent does it:
`AgentLink.Taint(reason="pause", terminate_at, grace_deadline)` with the node's certificate
(there is no operator drain verb). The coordinator turns the node's workload off and moves each
of its workers ready -> draining, removing it from the routing table, before it answers.
Timed from just before the Taint call to the moment each watcher receives the RouteUpdate
removing each of the node's workers:

  all-watchers  per run, the last of those: every router has seen every worker of the paused
                node go. The target is judged on this one (the strictest reading).
  each          every (watcher, worker) removal on its own.

Baseline, in the same run, just before each Taint on the same kind of channel: the round trip
of a trivial unary call, `Routes.PickWorker`. Also shown: the Taint call's own round trip.

Between runs (not timed): the fake node reports the drained workers stopped, the owner resumes
(`AgentLink.SetWorkload(enabled=true)`), the coordinator places the paused workers again
(placement path "resume"), the fake node reports them started, and the run waits until every
watcher has all of them again, then a random 10-40 ms pause.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
from benchnode import WAIT_S, FakeNode, channel, until  # noqa: E402
from benchutil import (  # noqa: E402
    base_environment,
    print_environment,
    say,
    summary,
    table,
    verdict,
)

from fakes.harness import Coordinator, start_coordinator  # noqa: E402
from fakes.pki import Pki  # noqa: E402
from spotdrain.v1 import spotdrain_pb2 as pb  # noqa: E402
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc  # noqa: E402

MODEL = "bench-model"
TARGET_P99_MS = 20.0


# --- a node, as the coordinator sees it --------------------------------------------------------


# --- a router's watch ---------------------------------------------------------------------------


class Watcher:
    def __init__(self, coord: Coordinator, pki: Pki | None, name: str) -> None:
        self.channel = channel(coord, pki.issue(f"router:{name}") if pki else None)
        self.stub = pb_grpc.RoutesStub(self.channel)
        self.table: dict[str, str] = {}  # worker id -> node id, as this router sees it
        self.removed_at: dict[str, float] = {}  # worker id -> perf_counter when seen removed
        self.updates = 0
        self.snapshot = asyncio.Event()
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        async for update in self.stub.WatchRoutes(pb.WatchRoutesRequest(model=MODEL)):
            seen = time.perf_counter()
            self.updates += 1
            if update.snapshot:
                self.table = {}
                self.snapshot.set()
            for route in update.upsert:
                self.table[route.worker_id] = route.node_id
            for worker_id in update.removed:
                self.table.pop(worker_id, None)
                self.removed_at.setdefault(worker_id, seen)

    def on_node(self, node_id: str) -> set[str]:
        return {w for w, n in self.table.items() if n == node_id}

    def check(self) -> None:
        if self._task.done():
            raise RuntimeError(f"a watch ended: {self._task.exception() or 'stream closed'}")

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.channel.close()


# --- the run ------------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, coord: Coordinator, pki: Pki | None) -> dict[str, Any]:
    nodes = [
        FakeNode(coord, pki, f"bench-node-{i}", args.workers_per_node) for i in range(args.nodes)
    ]
    watchers: list[Watcher] = []
    operator = channel(coord, coord.operator)
    picker = channel(coord, pki.issue("router:bench-pick") if pki else None)
    admin = pb_grpc.AdminStub(operator)
    routes = pb_grpc.RoutesStub(picker)
    samples: dict[str, list[float]] = {"pick": [], "taint_rtt": [], "all": [], "each": []}
    first_removal: list[float] = []
    try:
        for node in nodes:
            await node.connect()
        watchers = [Watcher(coord, pki, f"bench-watch-{i}") for i in range(args.watchers)]
        for w in watchers:
            async with asyncio.timeout(WAIT_S):
                await w.snapshot.wait()
        for node in nodes:
            for _ in range(args.workers_per_node):
                await admin.StartWorker(
                    pb.StartWorkerRequest(node_id=node.node_id, model=MODEL, image="fake", slots=4),
                    timeout=WAIT_S,
                )
        total = args.nodes * args.workers_per_node

        def all_routed() -> bool:
            for w in watchers:
                w.check()
            return all(len(w.table) == total for w in watchers)

        await until(all_routed, f"{total} workers routed at every watcher")
        say(f"{total} workers on {args.nodes} nodes routed at {args.watchers} watchers")

        token = uuid.uuid4().hex[:8]
        measured = args.warmup + args.runs
        for i in range(measured):
            node = nodes[i % len(nodes)]
            targets = watchers[0].on_node(node.node_id)
            assert len(targets) == args.workers_per_node, (node.node_id, targets)
            rid = f"rcl-bench-{token}-{i}"

            t = time.perf_counter()
            await routes.PickWorker(pb.PickWorkerRequest(model=MODEL), timeout=WAIT_S)
            pick_ms = (time.perf_counter() - t) * 1000

            t0 = time.perf_counter()
            await node.taint(rid)
            taint_ms = (time.perf_counter() - t0) * 1000

            def removed(node_id: str = node.node_id, targets: set[str] = targets) -> bool:
                for w in watchers:
                    w.check()
                return all(wid in w.removed_at for w in watchers for wid in targets)

            await until(removed, f"{node.node_id}'s workers removed at every watcher")
            each = [(w.removed_at[wid] - t0) * 1000 for w in watchers for wid in targets]
            if i >= args.warmup:
                samples["pick"].append(pick_ms)
                samples["taint_rtt"].append(taint_ms)
                samples["all"].append(max(each))
                samples["each"].extend(each)
                first_removal.append(min(each))
            done = i + 1 - args.warmup
            if done > 0 and (done % 50 == 0 or done == args.runs):
                say(f"  {done}/{args.runs} (last: all watchers {max(each):.2f} ms)")

            # Back to full service, outside the measurement.
            await until(lambda n=node, t=targets: t <= n.drained, "drain commands at the node")
            node.report_stopped(targets)
            await node.resume(rid)

            def back(node: FakeNode = node, old: set[str] = targets) -> bool:
                for w in watchers:
                    w.check()
                return all(
                    len(w.on_node(node.node_id)) == args.workers_per_node
                    and not (w.on_node(node.node_id) & old)
                    for w in watchers
                )

            await until(back, f"{node.node_id}'s workers placed again")
            await asyncio.sleep(random.uniform(0.010, 0.040))
        updates = [w.updates for w in watchers]
    finally:
        for w in watchers:
            await w.close()
        for node in nodes:
            await node.close()
        await picker.close()
        await operator.close()
    return {"samples_ms": samples, "first_removal_ms": first_removal, "watch_updates": updates}


def report(args: argparse.Namespace, result: dict[str, Any], env: dict, wall_s: float) -> dict:
    s = result["samples_ms"]
    stats = {name: summary(values) for name, values in s.items()}
    stats["first_removal"] = summary(result["first_removal_ms"])
    ok = stats["all"]["p99_ms"] <= TARGET_P99_MS
    print()
    print_environment(env)
    print(
        f"target: drain -> every watcher saw it, p99 <= {TARGET_P99_MS:.0f} ms on loopback "
        f"(judged on 'all watchers'); {args.runs} runs after {args.warmup} warm-up"
    )
    print()
    table(
        [
            ("baseline: Routes.PickWorker round trip", stats["pick"], "(baseline)"),
            ("AgentLink.Taint round trip", stats["taint_rtt"], "(the call itself)"),
            ("drain -> first watcher saw first worker", stats["first_removal"], ""),
            (
                "drain -> each (watcher, worker) removal",
                stats["each"],
                f"{args.watchers} watchers x {args.workers_per_node} workers per run",
            ),
            (
                "drain -> all watchers saw all removed",
                stats["all"],
                f"p99 <= {TARGET_P99_MS:.0f} ms: {verdict(ok)}",
            ),
        ]
    )
    base = stats["pick"]["p99_ms"]
    ratios = {
        name: stats[name]["p99_ms"] / base for name in ("all", "each", "taint_rtt") if base > 0
    }
    print()
    print(
        f"ratio p99 / PickWorker p99: all watchers {ratios.get('all', 0):.2f}x, "
        f"each {ratios.get('each', 0):.2f}x, Taint call {ratios.get('taint_rtt', 0):.2f}x"
    )
    print(f"RouteUpdates received per watcher: {result['watch_updates']}")
    print(f"wall time {wall_s:.1f} s")
    return {
        "benchmark": "drain_to_watch",
        "environment": env,
        "params": {
            "runs": args.runs,
            "warmup": args.warmup,
            "nodes": args.nodes,
            "workers_per_node": args.workers_per_node,
            "watchers": args.watchers,
            "transport": "insecure" if args.insecure else "mutual TLS",
        },
        "target": {"all_watchers_p99_ms": TARGET_P99_MS, "met": ok},
        "stats": stats,
        "ratios_p99_vs_pick": ratios,
        "samples_ms": s,
        "wall_s": wall_s,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=500, help="measured drains (default 500)")
    ap.add_argument("--warmup", type=int, default=4, help="drains before measuring (default 4)")
    ap.add_argument("--nodes", type=int, default=4, help="fake nodes (default 4)")
    ap.add_argument("--workers-per-node", type=int, default=4, help="default 4")
    ap.add_argument("--watchers", type=int, default=4, help="WatchRoutes clients (default 4)")
    ap.add_argument("--insecure", action="store_true", help="plaintext gRPC instead of mTLS")
    ap.add_argument("--json", type=Path, metavar="PATH", help="also write the numbers here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (coordinator log)")
    args = ap.parse_args(argv)
    for name in ("runs", "nodes", "workers_per_node", "watchers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="sdbench-watch-", dir="/tmp"))
    coord = None
    try:
        pki = None if args.insecure else Pki(work / "pki")
        coord = start_coordinator(work / "coordinator", tls=pki)
        env = {
            **base_environment(),
            "grpcio": grpc.__version__,
            "transport": "plaintext (--insecure)"
            if args.insecure
            else "mutual TLS (tests/fakes/pki.py)",
            "coordinator": f"{coord.address} pid {coord.proc.pid}",
        }
        say(f"work dir {work}; coordinator log {coord.proc.log_path}")
        result = asyncio.run(bench(args, coord, pki))
        doc = report(args, result, env, time.monotonic() - started)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=2) + "\n")
            say(f"wrote {args.json}")
        return 0
    finally:
        if coord is not None:
            coord.proc.stop()
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
