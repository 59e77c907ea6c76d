"""Benchmark: notice file written -> SIGTERM received inside a Slurm job step, on a real cluster.

Run on demand (pytest does not collect this file; it has no test functions):

    .venv/bin/python tests/bench/slurm_notice_to_sigterm.py [--runs 30] [--json PATH] [--keep]

Issue 23's target: spotdrain's p99 <= 2x the floor's p99 of the same run. Every run is one
iteration of each scenario, interleaved (floor, cancel, spotdrain), each on a fresh job:

  floor      a bare `scancel --signal=TERM <job>` -> probe line, timed from just before the call.
  cancel     a bare `scancel <job>`, the call the agent makes for a job that may not be requeued
             (slurmd's job termination: SIGCONT and SIGTERM to every step). A second baseline.
  spotdrain  the real `spotdrain-agent` ([workloads.slurm], docker off) with a coordinator over
             mutual TLS: DRAIN, list, cancel. Timed from just before the rename of the notice.

The job is a batch script (that ignores TERM) running one `srun` step; the step's task traps
TERM and writes "TERM <job id>" to a host FIFO, read by a thread blocked on it and stamped with
time.time() (SignalProbe in tests/fakes/dockerenv.py). The cluster (tests/fakes/slurm.py) and
everything else are started here and stopped again.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchutil import (  # noqa: E402
    PROBE_TIMEOUT_S,
    ProbeReader,
    Result,
    base_environment,
    print_environment,
    print_phases,
    say,
    summary,
    table,
    verdict,
    write_json,
)

from fakes.fakenvml import FakeGpus, build  # noqa: E402
from fakes.harness import Agent, AgentOptions, start_agent, start_coordinator  # noqa: E402
from fakes.pki import Pki  # noqa: E402
from fakes.slurm import SlurmCluster, start_cluster  # noqa: E402
from fakes.waiting import wait_until  # noqa: E402
from spotdrain.agent.core.reclamation import reclaim_id_for  # noqa: E402

SCENARIOS = ("floor", "cancel", "spotdrain")
NODE = "sd-n1"
NOTICE_AHEAD_S = 300.0  # terminate_at this far out: nothing reaches G during a run
TARGET_RATIO = 2.0
READY_TIMEOUT_S = 30.0
ENDED = {"COMPLETED", "CANCELLED", "FAILED"}

# The step's task: the probe line first thing in its trap; `wait` (not a foreground sleep) so
# bash runs the trap as soon as the signal comes.
TASK = """\
trap 'echo "TERM $SLURM_JOB_ID" >> "$SIGNAL_FIFO"; kill $! 2>/dev/null; exit 0' TERM
sleep 300 &
touch "$READY_DIR/$SLURM_JOB_ID"
wait
"""
# The batch shell ignores TERM and waits for its step, so the step's task is what ends the job.
BATCH = """\
trap '' TERM
srun --ntasks=1 bash {task} &
wait
wait
"""


class Bench:
    def __init__(self, work: Path, cluster: SlurmCluster) -> None:
        self.work = work
        self.cluster = cluster
        self.ready_dir = work / "ready"
        self.ready_dir.mkdir()
        self.probe = ProbeReader(work / "probe")
        task = work / "task.sh"
        task.write_text(TASK)
        self.batch = BATCH.format(task=task)
        self.env_arg = (
            f"--export=ALL,SIGNAL_FIFO={self.probe.probe.path},READY_DIR={self.ready_dir}"
        )
        self.pki = Pki(work / "pki")
        self.coord = start_coordinator(work / "coordinator", tls=self.pki)
        self.admin = self.coord.admin()
        self.nvml = build(work / "nvml")
        self.gpus = FakeGpus(work / "gpus.state")
        self.gpus.set(gpus=1)
        self.config = work / "agent.toml"
        self.config.write_text(
            "[workloads]\ndocker = false\n[workloads.slurm]\n"
            f'node_name = "{NODE}"\nbin_dir = "{cluster.bin_dir}"\nconf = "{cluster.conf}"\n'
            "call_timeout_s = 3\n"
        )
        self.token = f"{random.getrandbits(32):08x}"
        # Jobs whose step's task never ran its trap (srun's TERM-to-KILL won the race): by
        # scenario, the job id and the end of its output (srun's own lines are there).
        self.missed: dict[str, list[dict]] = {}
        self.runs: list[dict] = []  # spotdrain's runs one by one: total, phases, odd events

    def term_at(self, scenario: str, job: int) -> float | None:
        """When the step's TERM line was read; None (and the job noted) if none came."""
        try:
            return self.probe.wait(str(job), timeout=PROBE_TIMEOUT_S)
        except TimeoutError:
            self.wait_gone(job)
            out = self.cluster.output(job)[-600:]
            self.missed.setdefault(scenario, []).append({"job": job, "output": out})
            say(f"  {scenario}: job {job}'s step got no TERM; its output: {out!r}")
            return None

    # --- a fresh job, a fresh agent ---------------------------------------------------------

    def fresh_job(self) -> int:
        """A job on NODE whose step's task has set its trap."""
        job = self.cluster.submit(self.batch, NODE, name="bench", args=[self.env_arg])
        ready = self.ready_dir / str(job)
        try:
            wait_until(ready.exists, READY_TIMEOUT_S, f"job {job}'s step to set its trap", 0.01)
        except TimeoutError as e:
            info = self.cluster.cli("scontrol", "show", "job", str(job), check=False)
            raise RuntimeError(f"{e}\n{info}\n{self.cluster.output(job)}") from None
        return job

    def wait_gone(self, job: int) -> None:
        self.cluster.wait_state(job, ENDED)

    def fresh_agent(self, i: int) -> tuple[Agent, str]:
        """A new agent (a new node id, state dir and reclamation record) on NODE, resumed."""
        node_id = f"bench-{NODE}-{i}"
        agent = start_agent(
            self.work / "agents",
            node_id,
            self.coord,
            "unix:///nonexistent/docker.sock",
            self.gpus,
            self.nvml,
            AgentOptions(
                grace_s=10.0,
                overrun_s=2.0,
                default_notice_s=NOTICE_AHEAD_S,
                extra=["--config", str(self.config)],
            ),
        )
        wait_until(
            lambda: any(n.node_id == node_id and n.connected for n in self.admin.nodes()),
            20,
            f"{node_id} to register",
        )
        return agent, node_id

    # --- one measurement of each ------------------------------------------------------------

    def scancel(self, res: Result, *flags: str) -> None:
        job = self.fresh_job()
        settle()
        argv = [str(self.cluster.bin_dir / "scancel"), *flags, str(job)]
        t0 = time.time()
        subprocess.run(argv, env=self.cluster.env, check=True, capture_output=True)
        t_ret = time.time()
        t1 = self.term_at(res.scenario, job)
        if t1 is None:
            return
        res.samples_ms.append((t1 - t0) * 1000)
        res.add_phase("scancel call", (t_ret - t0) * 1000)
        res.add_phase("returned->probe", (t1 - t_ret) * 1000)
        self.wait_gone(job)

    def spotdrain(self, res: Result, i: int) -> None:
        agent, node_id = self.fresh_agent(i)
        try:
            job = self.fresh_job()
            settle()
            notice_id = f"bench-{self.token}-{i}"
            rid = reclaim_id_for(node_id, "id:" + notice_id)
            doc = {
                "id": notice_id,
                "action": "terminate",
                "terminate_at": time.time() + NOTICE_AHEAD_S,
                "source": "bench-relay",
            }
            tmp = agent.notice_file.with_name(".notice.tmp")
            tmp.write_text(json.dumps(doc))
            t0 = time.time()
            tmp.replace(agent.notice_file)
            t1 = self.term_at(res.scenario, job)
            if t1 is None:
                return
            res.samples_ms.append((t1 - t0) * 1000)
            self.admin.wait_for("drained", node=node_id, timeout=30, reclaim_id=rid)
            run = breakdown(res, self.admin.events(node=node_id, reclaim_id=rid), t0, t1)
            self.runs.append({"run": i, "node": node_id, "job": job, **run})
            self.wait_gone(job)
        finally:
            agent.proc.stop()
            self.resume_node()

    def resume_node(self) -> None:
        """Lift the agent's DRAIN (its reclamation stays open; the next run has a new agent)."""
        if "drain" in self.cluster.node_state(NODE):
            self.cluster.cli("scontrol", "update", f"NodeName={NODE}", "State=RESUME")
        wait_until(lambda: self.cluster.node_state(NODE) == "idle", 30, f"{NODE} idle")

    def close(self) -> None:
        self.coord.proc.stop()
        self.probe.close()


def settle() -> None:
    """A short random pause, so the step's start-up work is over before the timed call."""
    time.sleep(random.uniform(0.2, 0.4))


def breakdown(res: Result, events: list[dict], t0: float, t_probe: float) -> dict[str, Any]:
    """Where spotdrain's time went, from the agent's own event stamps (this host's clock); the
    run's phases, its taint mode and any cordon failure, for the JSON."""
    first: dict[str, dict] = {}
    for ev in events:
        first.setdefault(ev["kind"], ev)
    run: dict[str, Any] = {
        "total_ms": (t_probe - t0) * 1000,
        "taint_mode": first.get("tainted", {}).get("mode"),
        "cordon_failed": first.get("manager_cordon_failed", {}).get("error"),
    }
    try:
        seen = first["notice_received"]["wall_time"]  # T0
        tainted = first["tainted"]["wall_time"]
        cordoned = first["manager_cordoned"]
        sent = first["sigterm_sent"]["wall_time"]  # scancel returned
    except KeyError:
        return run
    phases = {
        "write->agent T0": (seen - t0) * 1000,
        "T0->tainted": (tainted - seen) * 1000,
        "T0->cordoned (DRAIN)": (cordoned["wall_time"] - seen) * 1000,
        "DRAIN calls (its ms)": float(cordoned.get("ms", float("nan"))),
        "both->sigterm_sent": (sent - max(tainted, cordoned["wall_time"])) * 1000,
        "sigterm_sent->probe": (t_probe - sent) * 1000,
    }
    for name, ms in phases.items():
        res.add_phase(name, ms)
    return {**run, **phases}


# --- report and main ----------------------------------------------------------------------


def report(
    results: dict[str, Result],
    missed: dict[str, list[dict]],
    runs: list[dict],
    env: dict,
    wall_s: float,
) -> dict[str, Any]:
    stats = {name: summary(r.samples_ms) for name, r in results.items()}
    print()
    print_environment(env)
    print(f"target: spotdrain p99 <= {TARGET_RATIO:.0f}x floor p99 (scancel --signal=TERM)")
    print()
    notes = {"floor": "(baseline)", "cancel": "(the agent's own call, bare)"}
    for name, jobs in missed.items():
        notes[name] = f"{notes.get(name, '')} {len(jobs)} step(s) got no TERM".strip()
    table([(name, stats[name], notes.get(name, "")) for name in SCENARIOS if name in stats], 14)
    checks: dict[str, bool] = {}
    ratios: dict[str, float] = {}
    floor_p99 = stats.get("floor", {}).get("p99_ms")
    if floor_p99:
        print()
        for name in ("spotdrain", "cancel"):
            if stats.get(name, {}).get("n"):
                ratios[name] = stats[name]["p99_ms"] / floor_p99
                print(f"ratio {name} p99 / floor p99 = {ratios[name]:.2f}x")
        if "spotdrain" in ratios:
            ok = ratios["spotdrain"] <= TARGET_RATIO
            checks[f"spotdrain p99 <= {TARGET_RATIO:.0f}x floor p99"] = ok
            print(f"target spotdrain p99 <= {TARGET_RATIO:.0f}x floor p99: {verdict(ok)}")
    phases = print_phases(results, ("spotdrain",))
    for name in ("floor", "cancel"):  # stamped here, before the call, after it, at the probe
        if name in results and results[name].phases_ms:
            print(f"\n{name}: the call and the delivery (this script's stamps; ms)")
            for phase, values in results[name].phases_ms.items():
                s = phases.setdefault(name, {})[phase] = summary(values)
                print(f"  {phase:<24} p50 {s['p50_ms']:8.1f}  p99 {s['p99_ms']:8.1f}")
    print()
    print(f"wall time {wall_s:.1f} s")
    return {
        "environment": env,
        "targets": {"spotdrain_vs_floor_p99": TARGET_RATIO},
        "stats": stats,
        "ratios_p99_vs_floor": ratios,
        "checks": checks,
        "phases": phases,
        "samples_ms": {name: r.samples_ms for name, r in results.items()},
        "no_term": missed,
        "spotdrain_runs": runs,
        "wall_s": wall_s,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30, help="measurements per scenario (30)")
    ap.add_argument(
        "--scenarios",
        nargs="+",
        choices=SCENARIOS,
        default=list(SCENARIOS),
        metavar="NAME",
        help=f"which to run (default all: {' '.join(SCENARIOS)})",
    )
    ap.add_argument("--json", type=Path, metavar="PATH", help="also write the numbers here")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs) afterwards")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="sdbench-slurm-", dir="/tmp"))
    say(f"work dir {work}")
    keep = args.keep
    results = {name: Result(name) for name in SCENARIOS if name in args.scenarios}
    cluster = bench = None
    try:
        env = base_environment()
        cluster = start_cluster()
        env["slurm"] = cluster.cli("sinfo", "--version").strip()
        env["cluster"] = f"{cluster.root} (KillWait {cluster.kill_wait_s} s)"
        bench = Bench(work, cluster)
        say(f"coordinator {bench.coord.address} (mutual TLS), jobs on {NODE}")
        for i in range(args.runs):
            # Interleaved, so the baselines and spotdrain see the same load on a shared host.
            if "floor" in results:
                bench.scancel(results["floor"], "--signal=TERM")
            if "cancel" in results:
                bench.scancel(results["cancel"])
            if "spotdrain" in results:
                bench.spotdrain(results["spotdrain"], i)
            if (i + 1) % 5 == 0 or i + 1 == args.runs:
                last = ", ".join(f"{r.scenario} {r.samples_ms[-1]:.1f}" for r in results.values())
                say(f"  {i + 1}/{args.runs} (last ms: {last})")
    except BaseException:
        keep = True  # the logs of a failed run are what explains it
        raise
    finally:
        if bench is not None:
            bench.close()
        if cluster is not None:
            cluster.stop()
        if keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    missed, runs = (bench.missed, bench.runs) if bench else ({}, [])
    doc = report(results, missed, runs, env, time.monotonic() - started)
    doc["runs"] = args.runs
    write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
