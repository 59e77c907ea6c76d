"""The demo: a coordinator, two agents on fake GPUs, real containers, a provider's notice,
and the timeline. Run it with tests/demo.sh (README.md); everything it starts, it cleans up.

    node-a gets the notice. It runs three batch jobs, each "holding" a GPU:
      quick     exits at once on SIGTERM
      ckpt      checkpoints for a few seconds, then exits
      stubborn  ignores SIGTERM (killed at the grace deadline G)
    node-b runs a job of its own, which must never be touched.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from dockerenv import ensure_engine, ensure_images, remove_test_containers, run_workload  # noqa: E402
from fakenvml import FakeGpus, build  # noqa: E402
from harness import BIN, AgentOptions, start_agent, start_coordinator, wait_until  # noqa: E402
from pki import Pki  # noqa: E402

PREFIX = "spotdrain-demo-"


def say(text: str) -> None:
    print(f"demo: {text}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description="spotdrain demo: one hard notice, end to end")
    ap.add_argument("--deadline", type=float, default=30.0,
                    help="seconds from the notice to the provider's deadline D (default 30)")
    ap.add_argument("--checkpoint-s", type=float, default=4.0,
                    help="how long the checkpointing job takes after SIGTERM")
    ap.add_argument("--keep", action="store_true", help="keep the work dir for inspection")
    args = ap.parse_args()
    if args.deadline < 4:
        ap.error("--deadline must be at least 4 seconds")
    # The default margins (G = D - 10 s, O = D - 2 s) are for a 120 s notice; short demo
    # deadlines scale them down so the timeline keeps its shape.
    grace = min(10.0, args.deadline / 3)
    overrun = min(2.0, grace / 3)

    work = Path(tempfile.mkdtemp(prefix="spotdrain-demo-"))
    started: list = []
    engine = None
    try:
        say(f"work dir {work}")
        engine = ensure_engine(work / "docker")
        say(f"Docker engine at {engine.host} ({'private' if engine.owned else 'system'})")
        ensure_images(engine.client)
        remove_test_containers(engine.client, PREFIX)
        lib = build(work / "nvml")
        pki = Pki(work / "pki")
        coord = start_coordinator(work / "coordinator", tls=pki)
        started.append(coord.proc)
        say(f"coordinator on {coord.address} (mutual TLS), SQLite at {coord.db}")

        options = AgentOptions(grace_s=grace, overrun_s=overrun, observe_every_s=0.25,
                               default_notice_s=args.deadline)
        agents, gpus = {}, {}
        for node in ("node-a", "node-b"):
            gpus[node] = FakeGpus(work / f"{node}.gpus")
            gpus[node].set(gpus=2)
            agents[node] = start_agent(work, node, coord, engine.host, gpus[node], lib, options)
            started.append(agents[node].proc)
        say("agents up on node-a and node-b, each with 2 fake GPUs (real pynvml)")

        client = engine.client
        jobs = {
            "quick": ("exits_on_term", {}),
            "ckpt": ("checkpoints", {"CHECKPOINT_S": str(args.checkpoint_s)}),
            "stubborn": ("ignores_term", {}),
        }
        containers = {}
        for i, (name, (behaviour, env)) in enumerate(jobs.items()):
            c = run_workload(client, name=PREFIX + name, node_id="node-a", kind=behaviour,
                             env={**env, "SPOTDRAIN_DEADLINE_FILE": "/run/spotdrain/deadline.json"})
            c.reload()
            gpus["node-a"].add_process(c.attrs["State"]["Pid"], gpu=i % 2)
            containers[name] = c
        bystander = run_workload(client, name=PREFIX + "node-b-job", node_id="node-b",
                                 kind="exits_on_term")
        bystander.reload()
        gpus["node-b"].add_process(bystander.attrs["State"]["Pid"], gpu=0)
        say("node-a runs quick, ckpt and stubborn (each holding a GPU); node-b runs its own job")

        admin = coord.admin()
        wait_until(lambda: sum(n.connected for n in admin.nodes()) == 2, 20, "both nodes")
        terminate_at = time.time() + args.deadline
        agents["node-a"].write_notice({
            "id": f"i-demo-{int(terminate_at)}", "action": "terminate",
            "terminate_at": terminate_at, "source": "demo-relay",
        })
        say(f"notice written to node-a: terminate in {args.deadline:.0f} s "
            f"(G = D - {grace:.1f} s, O = D - {overrun:.1f} s)")

        def outcome():
            kinds = admin.kinds(node="node-a")
            return "drained" if "drained" in kinds else "overrun" if "overrun" in kinds else None

        result = wait_until(outcome, args.deadline + 15, "the reclamation's outcome", 0.2)
        time.sleep(0.3)
        print()
        timeline = subprocess_text([str(BIN / "spotctl"), *coord.cli_args(), "timeline"])
        print(timeline)
        print()
        bystander.reload()
        say(f"node-b's job: {bystander.status} (never signalled)")
        for name, c in containers.items():
            c.reload()
            say(f"node-a {name}: {c.status}, exit code {c.attrs['State']['ExitCode']}")
        deadline_doc = json.loads(agents["node-a"].deadline_file.read_text())
        say(f"deadline file workloads read: {json.dumps(deadline_doc)}")
        say(f"outcome: {result}")
        ok = result == "drained" and bystander.status == "running"
        return 0 if ok else 1
    finally:
        for proc in reversed(started):
            proc.stop()
        if engine is not None:
            remove_test_containers(engine.client, PREFIX)
            engine.stop()
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def subprocess_text(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout


if __name__ == "__main__":
    sys.exit(main())
