"""Benchmark: a node reclaimed -> its replacement asked for (issue 4: replacements are started
elsewhere in parallel with the drain; on a hard notice another node group is asked within a second).

Run on demand (pytest does not collect this file; it has no test functions):

    .venv/bin/python tests/bench/reclaim_to_replacement.py [--runs 100] [--notice-runs 30]
        [--scenarios pause notice] [--json PATH] [--keep]

No Docker needed. Each scenario has its own real `spotdrain-coordinator` process (mutual TLS
from tests/fakes/pki.py); everything else is in this process, on one asyncio loop: fake nodes, each
on its own channel with its `node:<id>` certificate and a real `AgentLink.Connect` stream, answering
every start_worker at once with WorkerReport(state="started", gate_address=...) and stamping its
receipt with time.perf_counter(); an operator channel (Admin).
pause -> replacement start
    Nodes node-a, node-b, node-c (2 GPUs each, one group). The operator sets desired capacity:
    Admin.SetModelReplicas(model="m", replicas=2, image="img", slots=4); the workers land on two
    nodes. One run: the owner of a node holding a worker pauses it, as the agent does
    (AgentLink.Taint(reason="pause", terminate_at, grace_deadline) with the node's certificate).
    Timed from just before the Taint call to the moment the fake node that gets the replacement
    receives its start_worker. Also shown: when the coordinator recorded `worker_starting`
    (its own clock, against time.time() just before the call).
    Between runs (not timed): the paused node reports its drained worker stopped, the owner
    resumes (SetWorkload(enabled=true, reclaim_id)), and the run waits until ListModels says 2
    ready, none starting or draining, with one node free. The resumed node gets nothing back (the
    model already has its 2). The next node paused is the one whose worker is the oldest, so the
    pause moves round the three nodes and every run has a worker to lose.
    Baseline, just before each Taint: an Admin.ListModels round trip (a trivial unary call).

notice -> acquirer called
    The coordinator runs with `--acquirers FILE`: `[groups.group-b] exec = [python, SCRIPT, DIR]`.
    Fake node a1 in group "group-a", b1 in "group-b", no workers. One run: a1 gets a hard notice
    (Taint(reason="notice"), a fresh reclaim_id); timed from time.time() just before the Taint
    call to the time.time() the acquirer script takes as its first statement (then it reads the
    request from stdin and writes both to DIR/<request_id>.json). Also shown: when the
    coordinator recorded `replacement_requested` (the event it records just before running the
    command). Between runs (not timed): the run waits for `replacement_result` (ok), lifts the
    notice (Taint(remove=true)) and pauses 10-40 ms. group-a is avoided for 300 s after the
    first notice; that changes placements only, not this path.
    Baseline, in the same run just before each Taint: the same command spawned here with
    asyncio.create_subprocess_exec (pipes, its own session, as ExecAcquirer does) and a request
    of the same shape on stdin, timed the same way to the same recorded entry time. This is the
    floor: the Python interpreter's start dominates.

For both, the Taint call's own round trip: the agent waits for it before signalling anything,
so it must not grow because of the replacement work (which runs in the background).
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

MODEL = "m"
REPLICAS = 2
NOTICE_TARGET_MS = 1000.0  # "asks for replacement capacity from another node group within a second"
SCENARIOS = ("pause", "notice")

# The acquirer: its first statement takes the time, before anything else is imported or read.
ACQUIRE = """\
import time
entered = time.time()
import json, os, sys
request = json.load(sys.stdin)
out = os.path.join(sys.argv[1], request["request_id"] + ".json")
with open(out + ".tmp", "w") as f:
    json.dump({"entered": entered, "request": request}, f)
os.replace(out + ".tmp", out)
print(json.dumps({"instances": ["i-bench"]}))
"""


# --- a node, as the coordinator sees it --------------------------------------------------------


class Events:
    """The coordinator's event log, read after each run (follow=False: nothing in the timed
    window competes with the coordinator for its loop)."""

    def __init__(self, admin: pb_grpc.AdminStub) -> None:
        self.admin = admin
        self.last = 0

    async def new(self) -> list[pb.Event]:
        out = []
        request = pb.WatchEventsRequest(from_id=self.last, follow=False)
        async for stored in self.admin.WatchEvents(request, timeout=WAIT_S):
            self.last = max(self.last, stored.id)
            out.append(stored.event)
        return out


def progress(i: int, warmup: int, runs: int, last: str) -> None:
    done = i + 1 - warmup
    if done > 0 and (done % 25 == 0 or done == runs):
        say(f"  {done}/{runs} (last: {last})")


# --- pause -> replacement start -----------------------------------------------------------------


async def bench_pause(args: argparse.Namespace, coord: Coordinator, pki: Pki) -> dict[str, Any]:
    nodes = [FakeNode(coord, pki, f"node-{c}", 2) for c in "abc"]
    operator = channel(coord, coord.operator)
    admin = pb_grpc.AdminStub(operator)
    events = Events(admin)
    samples: dict[str, list[float]] = {
        "rtt": [],
        "taint_rtt": [],
        "replacement": [],
        "recorded": [],
    }
    extra_starts: list[int] = []  # runs that saw more than one start
    paused_order: list[str] = []
    try:
        for node in nodes:
            await node.connect()

        def starts() -> list[tuple[float, str, str]]:
            for n in nodes:
                n.check()
            return sorted(s for n in nodes for s in n.starts)

        async def model() -> pb.Model:
            reply = await admin.ListModels(pb.ListModelsRequest(), timeout=WAIT_S)
            (m,) = [m for m in reply.models if m.model == MODEL]
            return m

        async def settled() -> None:
            deadline = time.monotonic() + WAIT_S
            while True:
                m = await model()
                free = [n for n in nodes if not n.live]
                if (m.ready, m.starting, m.draining, len(free)) == (REPLICAS, 0, 0, 1):
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"model never settled: {m}; free nodes {len(free)}")
                await asyncio.sleep(0.01)

        await admin.SetModelReplicas(
            pb.SetModelReplicasRequest(model=MODEL, replicas=REPLICAS, image="img", slots=4),
            timeout=WAIT_S,
        )
        await settled()
        await events.new()
        say(f"{REPLICAS} workers of {MODEL!r} on " + ", ".join(n.node_id for n in nodes if n.live))

        token = uuid.uuid4().hex[:8]
        for i in range(args.warmup + args.runs):
            # The node whose worker is the oldest: the pause moves round the three nodes.
            node = min((n for n in nodes if n.live), key=lambda n: min(n.live.values()))
            lost = set(node.live)
            before = len(starts())
            rid = f"rcl-bench-{token}-{i}"

            t = time.perf_counter()
            await admin.ListModels(pb.ListModelsRequest(), timeout=WAIT_S)
            rtt_ms = (time.perf_counter() - t) * 1000

            wall0 = time.time()
            t0 = time.perf_counter()
            await node.taint(rid, "pause")
            taint_ms = (time.perf_counter() - t0) * 1000

            seen, target, wid = (await until(lambda b=before: starts()[b:], "a replacement"))[0]
            if target == node.node_id:
                raise RuntimeError(f"run {i}: the replacement went to the paused node {target}")
            replacement_ms = (seen - t0) * 1000

            # Back to full service, outside the measurement.
            await until(lambda n=node, w=lost: w <= n.drained, "the drain command at the node")
            node.report_stopped(lost)
            await node.resume(rid)
            await settled()
            recorded = [
                e
                for e in await events.new()
                if e.kind == "worker_starting" and json.loads(e.details_json)["worker_id"] == wid
            ]
            recorded_ms = (recorded[0].wall_time - wall0) * 1000 if recorded else float("nan")
            n_starts = len(starts()) - before
            if i >= args.warmup:
                samples["rtt"].append(rtt_ms)
                samples["taint_rtt"].append(taint_ms)
                samples["replacement"].append(replacement_ms)
                if recorded:
                    samples["recorded"].append(recorded_ms)
                paused_order.append(f"{node.node_id}->{target}")
                if n_starts != 1:
                    extra_starts.append(n_starts)
            progress(
                i,
                args.warmup,
                args.runs,
                f"{node.node_id} paused, {target} started its replacement {replacement_ms:.2f} ms",
            )
            await asyncio.sleep(random.uniform(0.010, 0.040))
    finally:
        for node in nodes:
            await node.close()
        await operator.close()
    moves: dict[str, int] = {}
    for m in paused_order:
        moves[m] = moves.get(m, 0) + 1
    return {"samples_ms": samples, "runs_with_extra_starts": extra_starts, "moves": moves}


# --- notice -> acquirer called ------------------------------------------------------------------


def acquirer_setup(work: Path) -> tuple[Path, list[str], Path]:
    """(the --acquirers file, the command, the directory the script writes to)."""
    work.mkdir(parents=True, exist_ok=True)
    script = work / "acquire.py"
    script.write_text(ACQUIRE)
    out = work / "acquired"
    out.mkdir()
    argv = [sys.executable, str(script), str(out)]
    config = work / "acquirers.toml"
    config.write_text(
        f"avoid_s = 300\n[groups.group-b]\nexec = {json.dumps(argv)}\ntimeout_s = 10\n"
    )
    return config, argv, out


async def entered(out: Path, request_id: str) -> dict[str, Any]:
    path = out / f"{request_id}.json"
    await until(path.exists, f"the acquirer's record {path.name}", every=0.002)
    return json.loads(path.read_text())


async def bench_notice(
    args: argparse.Namespace, coord: Coordinator, pki: Pki, argv: list[str] | None, out: Path
) -> dict[str, Any]:
    """With `argv` None, the control: the coordinator has no acquirers file, so each notice
    records `replacement_unavailable` and spawns nothing; only the Taint round trip counts."""
    a1 = FakeNode(coord, pki, "a1", 2, group="group-a")
    b1 = FakeNode(coord, pki, "b1", 2, group="group-b")
    operator = channel(coord, coord.operator)
    events = Events(pb_grpc.AdminStub(operator))
    samples: dict[str, list[float]] = {
        "spawn": [],
        "taint_rtt": [],
        "acquirer": [],
        "requested": [],
        "requested_to_entry": [],
    }
    durations: list[float] = []
    failures: list[str] = []
    requests: list[dict[str, Any]] = []
    try:
        await a1.connect()
        await b1.connect()
        token = uuid.uuid4().hex[:8]
        for i in range(args.warmup + args.notice_runs):
            rid = f"rcl-bench-{token}-{i}"

            spawn_ms = float("nan")
            if argv is not None:
                spawn_ms = await spawn_here(argv, out, f"base-{token}-{i}")

            wall0 = time.time()
            t0 = time.perf_counter()
            await a1.taint(rid, "notice")
            taint_ms = (time.perf_counter() - t0) * 1000
            record: dict[str, Any] = {}
            acquirer_ms = float("nan")
            if argv is not None:
                record = await entered(out, f"acq-{rid}")
                acquirer_ms = (record["entered"] - wall0) * 1000

            # Not timed: the acquirer's answer recorded, then the notice lifted.
            last = "replacement_result" if argv is not None else "replacement_unavailable"
            result: list[pb.Event] = []
            requested: list[pb.Event] = []
            deadline = time.monotonic() + WAIT_S
            while not result:
                for e in await events.new():
                    if e.reclaim_id == rid and e.kind == last:
                        result.append(e)
                    elif e.reclaim_id == rid and e.kind == "replacement_requested":
                        requested.append(e)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {last} for {rid}")
                if not result:
                    await asyncio.sleep(0.02)
            doc = json.loads(result[0].details_json)
            await a1.taint(rid, "notice", remove=True)

            if i >= args.warmup:
                samples["taint_rtt"].append(taint_ms)
                if argv is not None:
                    samples["spawn"].append(spawn_ms)
                    samples["acquirer"].append(acquirer_ms)
                    if requested:
                        req_ms = (requested[0].wall_time - wall0) * 1000
                        samples["requested"].append(req_ms)
                        samples["requested_to_entry"].append(acquirer_ms - req_ms)
                    durations.append(doc["duration_s"] * 1000)
                    if not doc["ok"]:
                        failures.append(doc["detail"])
                    requests.append(record["request"])
            progress(
                i,
                args.warmup,
                args.notice_runs,
                f"Taint {taint_ms:.2f} ms"
                + (
                    f", acquirer entered {acquirer_ms:.1f} ms, spawned here {spawn_ms:.1f} ms"
                    if argv is not None
                    else f", {last}"
                ),
            )
            await asyncio.sleep(random.uniform(0.010, 0.040))
    finally:
        await a1.close()
        await b1.close()
        await operator.close()
    return {
        "samples_ms": samples,
        "acquirer_duration_ms": durations,
        "failures": failures,
        "last_request": requests[-1] if requests else None,
    }


async def spawn_here(argv: list[str], out: Path, request_id: str) -> float:
    """The baseline: the same command spawned here, as ExecAcquirer does it, with a request
    of the same shape; ms from just before the spawn to the script's recorded entry."""
    base = {
        "request_id": request_id,
        "reclaimed_node": "a1",
        "reclaimed_group": "group-a",
        "target_group": "group-b",
        "gpus": 2,
        "models": [],
        "reason": "notice",
        "deadline": time.time() + 120,
    }
    spawned = time.time()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    await proc.communicate(json.dumps(base, sort_keys=True).encode())
    if proc.returncode != 0:
        raise RuntimeError(f"the acquirer script exited {proc.returncode}")
    return ((await entered(out, request_id))["entered"] - spawned) * 1000


# --- report -------------------------------------------------------------------------------------


def report_pause(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    s = result["samples_ms"]
    stats = {name: summary(values) for name, values in s.items()}
    print(f"pause -> replacement start: {args.runs} runs after {args.warmup} warm-up")
    print()
    table(
        [
            ("baseline: Admin.ListModels round trip", stats["rtt"], "(baseline)"),
            ("AgentLink.Taint(pause) round trip", stats["taint_rtt"], "(the call itself)"),
            ("pause -> worker_starting recorded", stats["recorded"], "(coordinator's clock)"),
            ("pause -> start_worker at the new node", stats["replacement"], ""),
        ]
    )
    base = stats["rtt"]["p99_ms"]
    ratios = {n: stats[n]["p99_ms"] / base for n in ("replacement", "taint_rtt") if base > 0}
    print()
    print(
        f"ratio p99 / ListModels p99: replacement {ratios.get('replacement', 0):.2f}x, "
        f"Taint call {ratios.get('taint_rtt', 0):.2f}x"
    )
    print(f"paused -> replaced on: {result['moves']}")
    extra = result["runs_with_extra_starts"]
    print(f"runs with other than one start: {len(extra)} {extra if extra else ''}")
    return {
        "params": {"runs": args.runs, "warmup": args.warmup, "nodes": 3, "replicas": REPLICAS},
        "stats": stats,
        "ratios_p99_vs_list_models": ratios,
        "moves": result["moves"],
        "runs_with_extra_starts": extra,
        "samples_ms": s,
    }


def report_notice(
    args: argparse.Namespace, result: dict[str, Any], control: dict[str, Any]
) -> dict[str, Any]:
    s = result["samples_ms"]
    stats = {name: summary(values) for name, values in s.items()}
    stats["acquirer_duration"] = summary(result["acquirer_duration_ms"])
    stats["control_taint_rtt"] = summary(control["samples_ms"]["taint_rtt"])
    ok = stats["acquirer"]["p99_ms"] <= NOTICE_TARGET_MS and not result["failures"]
    print(
        f"notice -> acquirer called: {args.notice_runs} runs after {args.warmup} warm-up; "
        f"target p99 <= {NOTICE_TARGET_MS:.0f} ms"
    )
    print()
    table(
        [
            ("baseline: spawn the same command here", stats["spawn"], "(floor)"),
            ("AgentLink.Taint(notice) round trip", stats["taint_rtt"], "(the call itself)"),
            (
                "control: Taint(notice), no acquirers file",
                stats["control_taint_rtt"],
                "(another coordinator; nothing spawned)",
            ),
            (
                "notice -> replacement_requested recorded",
                stats["requested"],
                "(coordinator's clock)",
            ),
            ("replacement_requested -> acquirer entered", stats["requested_to_entry"], ""),
            (
                "notice -> acquirer entered",
                stats["acquirer"],
                f"p99 <= {NOTICE_TARGET_MS:.0f} ms: {verdict(ok)}",
            ),
            ("acquirer's whole call (replacement_result)", stats["acquirer_duration"], ""),
        ]
    )
    base = stats["spawn"]["p99_ms"]
    ratio = stats["acquirer"]["p99_ms"] / base if base > 0 else 0.0
    print()
    print(f"ratio p99 / spawn-here p99: {ratio:.2f}x")
    print(f"acquirer failures: {len(result['failures'])} {result['failures'][:3]}")
    print(f"last request: {json.dumps(result['last_request'], sort_keys=True)}")
    return {
        "params": {"runs": args.notice_runs, "warmup": args.warmup},
        "target": {"acquirer_entered_p99_ms": NOTICE_TARGET_MS, "met": ok},
        "stats": stats,
        "ratio_p99_vs_spawn": ratio,
        "failures": result["failures"],
        "last_request": result["last_request"],
        "samples_ms": s,
        "control_taint_rtt_ms": control["samples_ms"]["taint_rtt"],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=100, help="measured pauses (default 100)")
    ap.add_argument("--notice-runs", type=int, default=30, help="measured notices (default 30)")
    ap.add_argument("--warmup", type=int, default=2, help="runs before measuring (default 2)")
    ap.add_argument(
        "--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS), help="default both"
    )
    ap.add_argument("--json", type=Path, metavar="PATH", help="also write the numbers here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (coordinator logs)")
    args = ap.parse_args(argv)
    for name in ("runs", "notice_runs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="sdbench-replace-", dir="/tmp"))
    env = {**base_environment(), "grpcio": grpc.__version__, "transport": "mutual TLS"}
    doc: dict[str, Any] = {"benchmark": "reclaim_to_replacement", "environment": env}
    reports: list[tuple[str, Any]] = []
    try:
        pki = Pki(work / "pki")
        say(f"work dir {work}")
        if "pause" in args.scenarios:
            coord = start_coordinator(work / "coordinator-pause", tls=pki)
            try:
                say(f"pause: coordinator pid {coord.proc.pid}, log {coord.proc.log_path}")
                result = asyncio.run(bench_pause(args, coord, pki))
            finally:
                coord.proc.stop()
            reports.append(("pause", lambda r=result: report_pause(args, r)))
        if "notice" in args.scenarios:
            config, command, out = acquirer_setup(work / "acquirer")
            coord = start_coordinator(
                work / "coordinator-notice", tls=pki, extra=("--acquirers", str(config))
            )
            try:
                say(f"notice: coordinator pid {coord.proc.pid}, log {coord.proc.log_path}")
                result = asyncio.run(bench_notice(args, coord, pki, command, out))
            finally:
                coord.proc.stop()
            # The control: the same notices, no acquirers file (nothing spawned).
            coord = start_coordinator(work / "coordinator-control", tls=pki)
            try:
                say(f"notice control: coordinator pid {coord.proc.pid}, no --acquirers")
                control = asyncio.run(bench_notice(args, coord, pki, None, out))
            finally:
                coord.proc.stop()
            reports.append(("notice", lambda r=result, c=control: report_notice(args, r, c)))
        print()
        print_environment(env)
        for name, show in reports:
            print()
            doc[name] = show()
        wall_s = time.monotonic() - started
        print()
        print(f"wall time {wall_s:.1f} s")
        doc["wall_s"] = wall_s
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=2) + "\n")
            say(f"wrote {args.json}")
        return 0
    finally:
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
