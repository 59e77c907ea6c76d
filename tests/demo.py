"""The demo: a coordinator, three agents on fake GPUs, real containers, live inference traffic
through the reference router, a renter's container, an owner's pause and a provider's notice,
and the timelines. Run it with tests/demo.sh (README.md); everything it starts, it cleans up.

    node-a and node-b are spot nodes of group spot-a; node-c is an on-demand node of group
    ondemand-b, free at first. The model fake-model is wanted twice (desired capacity): its
    workers land on node-a and node-b, behind their slot gates. Alice rents a GPU on node-a.
    Batch jobs each "hold" a GPU on node-a:
      quick     exits at once on SIGTERM
      ckpt      the reference checkpointing job (examples/checkpoint_job): holds state in
                memory and on SIGTERM writes its final checkpoint to a bucket (a directory),
                reporting it through its status directory; the timeline shows its steps
      stubborn  ignores SIGTERM (killed at the grace deadline G)
    Clients stream short answers through the router the whole time; one long answer is on
    node-a when its owner pauses it: cut at G, the router continues it on another worker, and
    the demo says where its two halves were generated.

    Act 1: node-a's owner pauses it mid-traffic (D = pause + --deadline). Alice's rental gets
    reclaim_at = G and runs until then; the model's lost worker is replaced on node-c while
    node-a still drains.
    Act 2: the provider sends node-b a hard notice (terminate at notice + --deadline). The
    coordinator asks group ondemand-b's acquirer for capacity at once, avoids group spot-a, and
    replaces node-b's worker on node-c: the clients never run out of workers.

    --slurm: then act 3, on a private Slurm cluster: a requeueable training job's node gets a
    notice; the job is requeued after the DRAIN and runs on from its checkpoint elsewhere.

    --ha: the same on two coordinator replicas over a throwaway PostgreSQL
    (tests/fakes/pgserver.py), every agent, the router and spotctl given both addresses
    (docs/fleet.md "Several replicas"). Halfway from the pause to G the leader is SIGKILLed; the
    other replica takes the lease, and the rest of both acts runs on it with every promise kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import docker.types  # noqa: E402
import grpc  # noqa: E402
import psycopg  # noqa: E402
from demo_slurm import slurm_act  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from fakes.dockerenv import (  # noqa: E402
    ensure_engine,
    ensure_images,
    ensure_rental_image,
    remove_test_containers,
    run_workload,
)
from fakes.fakenvml import FakeGpus, build  # noqa: E402
from fakes.harness import (
    BIN,
    Admin,
    AgentOptions,
    Coordinator,
    start_agent,
    start_coordinator,
    start_router,
)
from fakes.pgserver import fresh_database, start_postgres  # noqa: E402
from fakes.pki import Pki  # noqa: E402
from fakes.waiting import wait_until
from images.checkpoint_job import ensure_checkpoint_job_image  # noqa: E402
from images.fake_model import ensure_model_image  # noqa: E402
from spotdrain.agent.workloads.jobs import CONTAINER_DEADLINE_DIR  # noqa: E402
from spotdrain.agent.workloads.status_dirs import CONTAINER_STATUS_DIR  # noqa: E402
from spotdrain.v1 import spotdrain_pb2 as pb  # noqa: E402
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc  # noqa: E402
from spotdrain.workload import (  # noqa: E402
    DEADLINE_FILE_ENV,
    KIND_LABEL,
    NODE_LABEL,
    STATUS_DIR_ENV,
)

PREFIX = "spotdrain-demo-"
# --ha: how long the demo's own calls wait for a leader while one is replaced (spotctl's
# --leader-wait-s is the same 10 s).
LEADER_WAIT_S = 10.0


def say(text: str) -> None:
    print(f"demo: {text}", flush=True)


@dataclasses.dataclass
class Clients:
    """The demo's own calls to one coordinator: as the operator, and as alice the renter."""

    coordinator: Coordinator
    admin: Admin
    ops: pb_grpc.AdminStub
    renter: pb_grpc.RentalsStub


class Coordinators:
    """The coordinator, or with --ha its replicas (named a, b). The demo's own calls go to
    the one that leads, found by its health (only the leader's AgentLink is SERVING); with
    --ha a call a replica refused or could not answer waits for the next leader."""

    def __init__(self, replicas: dict[str, Coordinator], alice, ha: bool) -> None:  # noqa: ANN001
        self.replicas, self.ha = replicas, ha
        self.clients = {
            name: Clients(
                c, c.admin(), pb_grpc.AdminStub(c.channel()), pb_grpc.RentalsStub(c.channel(alice))
            )
            for name, c in replicas.items()
        }

    def everywhere(self) -> Coordinator:
        """The first coordinator with every address, as the router and spotctl take them."""
        first = next(iter(self.replicas.values()))
        return dataclasses.replace(
            first, address=",".join(c.address for c in self.replicas.values())
        )

    def leader(self, timeout: float = LEADER_WAIT_S) -> str:
        """The name of the replica that leads now (waiting for one while it is replaced)."""
        if not self.ha:
            return next(iter(self.replicas))
        return wait_until(
            lambda: next(
                (
                    name
                    for name, c in self.replicas.items()
                    if c.proc.popen.poll() is None and leading(c)
                ),
                None,
            ),
            timeout,
            "a replica to lead",
            every=0.02,
        )

    def call(self, what, retry: bool = True):  # noqa: ANN001, ANN201
        """what(clients of the leader). With --ha, and `retry`, a refusal or a replica gone is
        tried again at the leader then, for up to LEADER_WAIT_S (never for a call that may
        have run: CreateRental is sent once)."""
        if not self.ha:
            return what(self.clients[self.leader()])
        given_up = time.monotonic() + LEADER_WAIT_S
        while True:
            try:
                return what(self.clients[self.leader()])
            except grpc.RpcError as e:
                moved = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                if not (retry and moved) or time.monotonic() > given_up:
                    raise
                time.sleep(0.1)


def leading(coordinator: Coordinator) -> bool:
    """Its AgentLink SERVING: a replica that leads and has rebuilt
    (coordinator/replicas/leadership.py)."""
    with coordinator.channel() as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="spotdrain.v1.AgentLink"), timeout=0.5
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def start_replica(work: Path, db: str, pki: Pki, extra: tuple[str, ...]) -> Coordinator:
    """A coordinator replica on `db`, advertising the port it listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return start_coordinator(
        work, tls=pki, db=db, port=port, extra=("--advertise", f"127.0.0.1:{port}", *extra)
    )


def lease_term(db: str) -> tuple[int, str]:
    """The leader lease as PostgreSQL holds it: (term, the holder's address)."""
    with psycopg.connect(db) as conn:
        [(term, holder)] = conn.execute("SELECT term, holder FROM leader_lease").fetchall()
    return term, holder.split(" ")[0]


def steps_not_once(fleet: Coordinators, reclaim_id: str) -> list[str]:
    """The steps of a reclamation that must be stored once and were not (the agents resend
    what the dead leader may not have stored; the new one must store it once)."""
    kinds = [e["kind"] for e in fleet.call(lambda c: c.admin.events(reclaim_id=reclaim_id))]
    once = ("notice_received", "tainted", "deadline_file_written", "verified_empty", "drained")
    return [f"{k} x{kinds.count(k)}" for k in once if kinds.count(k) != 1]


class Traffic:
    """Clients streaming short answers through the router until stopped; counts outcomes."""

    def __init__(self, router_url: str, clients: int = 4) -> None:
        self.url = router_url + "/v1/chat/completions"
        self.completed = self.interrupted = self.refused = self.failed = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            outcome = stream(self.url, tokens=8, pace=10)[0]
            with self.lock:
                setattr(self, outcome, getattr(self, outcome) + 1)
            if outcome == "refused":
                time.sleep(0.5)  # no worker anywhere: back off as a real client would

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def say_long_answer(fleet, long_answer: list) -> None:  # noqa: ANN001 (the demo's fleet)
    """Where the long answer that node-a's pause cut was generated: its first half on node-a
    until G, the rest on the worker the router continued it on (its `stream_continued`)."""
    try:
        wait_until(lambda: long_answer, 90, "the long answer to end", every=0.5)
    except TimeoutError:
        say("the long answer on node-a: still open")
        return
    how, first, chars = long_answer[0]
    continued = [
        e
        for e in fleet.call(lambda c: c.admin.events(node="node-a"))
        if e["kind"] == "stream_continued"
    ]
    if not continued:
        say(f"the long answer on node-a: {how}, {chars} characters")
        return
    seam = continued[0]
    workers = fleet.call(lambda c: c.ops.ListWorkers(pb.ListWorkersRequest(), timeout=10))
    node = next((w.node_id for w in workers.workers if w.worker_id == seam["to_worker_id"]), "?")
    say(
        f"the long answer: {how}, {chars} characters in one stream: the first "
        f"{seam['chars']} generated by worker {first} on node-a until G, the other "
        f"{chars - seam['chars']} by worker {seam['to_worker_id']} on {node}, "
        f"{seam['gap_ms']:.0f} ms later (the router continued it)"
    )


def stream(url: str, tokens: int, pace: float) -> tuple[str, str, int]:
    """One streamed completion: (completed | interrupted | refused | failed, the worker that
    began it, characters of answer)."""
    body = json.dumps(
        {
            "model": "fake-model",
            "stream": True,
            "max_tokens": tokens,
            "messages": [{"role": "user", "content": "hello"}],
        }
    ).encode()
    req = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "X-Fake-Tokens-Per-S": str(pace)},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            worker = resp.headers.get("X-Worker-Id", "")
            lines = [raw.decode().strip() for raw in resp]
    except urllib.error.HTTPError as e:
        return ("refused" if e.code == 503 else "failed"), "", 0
    except OSError:
        return "failed", "", 0
    chars = 0
    for line in lines:
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices") or []:
                chars += len((choice.get("delta") or {}).get("content") or "")
    if "data: [DONE]" in lines:
        return "completed", worker, chars
    if any(line.startswith("event: error") for line in lines):
        return "interrupted", worker, chars
    return "failed", worker, chars


ACQUIRE = """
import json, sys, time
request = json.load(sys.stdin)
with open(sys.argv[1], "a") as log:
    log.write(json.dumps({"at": time.time(), "request": request}) + "\\n")
print(json.dumps({"accepted": True, "instances": ["i-ondemand-new"]}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description="spotdrain demo: a pause and a notice, end to end")
    ap.add_argument(
        "--deadline",
        type=float,
        default=30.0,
        help="seconds from the pause or notice to its deadline D (default 30)",
    )
    ap.add_argument(
        "--checkpoint-mb",
        type=float,
        default=256.0,
        help="state the checkpointing job holds, and writes at its final checkpoint",
    )
    ap.add_argument("--keep", action="store_true", help="keep the work dir for inspection")
    ap.add_argument(
        "--ha",
        action="store_true",
        help="two coordinator replicas over PostgreSQL; the leader is SIGKILLed in "
        "the middle of act 1",
    )
    ap.add_argument(
        "--slurm",
        action="store_true",
        help="an act 3 on a private Slurm cluster: a training job requeued on the notice "
        "resumes from its checkpoint on another node (tests/demo_slurm.py)",
    )
    args = ap.parse_args()
    if args.deadline < 6:
        ap.error("--deadline must be at least 6 seconds")
    # The default margins (G = D - 10 s, O = D - 2 s) are for a 120 s notice; short demo
    # deadlines scale them down so the timeline keeps its shape.
    grace = min(10.0, args.deadline / 3)
    overrun = min(2.0, grace / 3)

    work = Path(tempfile.mkdtemp(prefix="spotdrain-demo-"))
    started: list = []
    engine = None
    traffic = None
    postgres = None
    try:
        say(f"work dir {work}")
        engine = ensure_engine(work / "docker")
        say(f"Docker engine at {engine.host} ({'private' if engine.owned else 'system'})")
        images = ensure_images(engine.client)
        rental_image = ensure_rental_image(engine.client, images["base"])
        say("building the fake model image (first run on a machine: about a minute)")
        image = ensure_model_image(engine.client)
        job_image = ensure_checkpoint_job_image(engine.client)
        for prefix in (PREFIX, "spotdrain-w-", "spotdrain-rental-"):
            remove_test_containers(engine.client, prefix)
        lib = build(work / "nvml")
        pki = Pki(work / "pki")
        acquired = work / "acquired.jsonl"
        (work / "acquire.py").write_text(ACQUIRE)
        (work / "acquirers.toml").write_text(
            "avoid_s = 300\n[groups.ondemand-b]\n"
            f'exec = ["{sys.executable}", "{work / "acquire.py"}", "{acquired}"]\n'
        )
        acquirers = ("--acquirers", str(work / "acquirers.toml"))
        if args.ha:
            postgres = start_postgres()
            db = fresh_database(postgres, "spotdrain_demo")
            replicas = {"a": start_replica(work / "replica-a", db, pki, acquirers)}
            started.append(replicas["a"].proc)
            wait_until(lambda: leading(replicas["a"]), 20, "replica a to lead")
            replicas["b"] = start_replica(work / "replica-b", db, pki, acquirers)
            started.append(replicas["b"].proc)
            wait_until(lambda: "following" in replicas["b"].proc.log(), 20, "replica b to follow")
            say(
                f"coordinator replicas a on {replicas['a'].address} (leading) and b on "
                f"{replicas['b'].address} (following), mutual TLS, PostgreSQL {db}"
            )
        else:
            replicas = {"": start_coordinator(work / "coordinator", tls=pki, extra=acquirers)}
            started.append(replicas[""].proc)
            say(f"coordinator on {replicas[''].address} (mutual TLS), SQLite at {replicas[''].db}")
        fleet = Coordinators(replicas, pki.issue("renter:alice"), args.ha)
        coord = fleet.everywhere()  # what agents, the router and spotctl are given

        agents, gpus = {}, {}
        nodes = {
            "node-a": ("spot-a", True),
            "node-b": ("spot-a", True),
            "node-c": ("ondemand-b", False),
        }
        for node, (group, spot) in nodes.items():
            options = AgentOptions(
                grace_s=grace,
                overrun_s=overrun,
                observe_every_s=0.25,
                default_notice_s=args.deadline,
                extra=[
                    "--pause-notice-s",
                    str(args.deadline),
                    "--node-group",
                    group,
                    "--spot",
                    str(spot).lower(),
                    "--provider",
                    f"owner-of-{node}",
                ],
            )
            gpus[node] = FakeGpus(work / f"{node}.gpus")
            gpus[node].set(gpus=2)
            agents[node] = start_agent(work, node, coord, engine.host, gpus[node], lib, options)
            started.append(agents[node].proc)
        wait_until(
            lambda: sum(n.connected for n in fleet.call(lambda c: c.admin.nodes())) == 3,
            20,
            "all three nodes",
        )
        say(
            "agents up: node-a and node-b (spot, group spot-a), node-c (on-demand, group "
            "ondemand-b), each with 2 fake GPUs (real pynvml)"
        )

        client = engine.client
        containers = {
            "quick": run_workload(
                client, name=PREFIX + "quick", node_id="node-a", kind="exits_on_term"
            ),
            "ckpt": run_checkpoint_job(
                client,
                job_image,
                agents["node-a"],
                PREFIX + "ckpt",
                work / "bucket",
                args.checkpoint_mb,
            ),
            "stubborn": run_workload(
                client, name=PREFIX + "stubborn", node_id="node-a", kind="ignores_term"
            ),
        }
        for i, c in enumerate(containers.values()):
            c.reload()
            gpus["node-a"].add_process(c.attrs["State"]["Pid"], gpu=i % 2)
        say(
            f"node-a runs batch jobs quick, ckpt ({args.checkpoint_mb:.0f} MB of state, its "
            "bucket a directory) and stubborn, each holding a GPU"
        )

        router = start_router(work / "router", coord)
        started.append(router.proc)
        spotctl = [str(BIN / "spotctl"), *coord.cli_args()]
        long_answer: list = []

        def ready(count: int) -> bool:
            models = fleet.call(lambda c: c.ops.ListModels(pb.ListModelsRequest(), timeout=10))
            return models.models[0].ready >= count

        # One worker first, so the long answer lands on node-a; then the second one.
        subprocess_text(
            [
                *spotctl,
                "models",
                "set-replicas",
                "fake-model",
                "1",
                "--image",
                image,
                "--slots",
                "8",
            ]
        )
        wait_until(lambda: ready(1), 90, "the first worker to be ready", every=0.2)
        threading.Thread(
            target=lambda: long_answer.append(
                # About 75 s of answer: cut at node-a's G, finished by another worker.
                stream(router.url + "/v1/chat/completions", tokens=3_000, pace=40)
            ),
            daemon=True,
        ).start()
        time.sleep(0.5)
        subprocess_text([*spotctl, "models", "set-replicas", "fake-model", "2"])
        wait_until(lambda: ready(2), 90, "the second worker to be ready", every=0.2)
        say("`spotctl models set-replicas fake-model 2`: workers on the least-loaded nodes")
        print(subprocess_text([*spotctl, "workers", "list"]))

        rental = fleet.call(
            lambda c: c.renter.CreateRental(
                pb.CreateRentalRequest(node_id="node-a", image=rental_image), timeout=30
            ),
            retry=False,
        )

        def alices() -> pb.Rental:
            return fleet.call(
                lambda c: c.renter.GetRental(
                    pb.GetRentalRequest(rental_id=rental.rental_id), timeout=10
                )
            )

        wait_until(lambda: alices().state == "running", 30, "alice's rental to run")
        say(f"alice rents a GPU on node-a: rental {rental.rental_id}, through the placement gate")

        traffic = Traffic(router.url)
        time.sleep(3)
        say(f"traffic flowing: {traffic.completed} answers completed so far")

        # --- act 1: the owner pauses node-a ------------------------------------------------
        print()
        say("ACT 1: node-a's owner runs `spotctl pause`")
        paused_at = time.time()
        answer = subprocess_json(
            [str(BIN / "spotctl"), "--socket", str(agents["node-a"].socket), "pause", "--json"]
        )
        say(f"pause accepted: reclamation {answer.get('reclaim_id')}, D in {args.deadline:.0f} s")
        told = wait_until(lambda: (r := alices()).HasField("reclaim_at") and r, 10, "reclaim_at")
        say(
            f"alice is told reclaim_at = pause + {told.reclaim_at - paused_at:.1f} s "
            "(the grace deadline G), in the API, her watch stream and her deadline file"
        )
        replaced = fleet.call(
            lambda c: c.admin.wait_for("worker_starting", node="node-c", timeout=20)
        )
        say(
            f"the lost worker's replacement {replaced['worker_id']} starts on node-c "
            f"{replaced['wall_time'] - paused_at:.2f} s after the pause, while node-a drains"
        )
        failover = None
        if args.ha:
            # Halfway from the pause to G: node-a drains, ckpt checkpoints, alice's rental
            # and the long answer run until G, and node-c's replacement may still be starting.
            failover = kill_the_leader(
                fleet, db, paused_at + (args.deadline - grace) / 2, paused_at
            )
        result_a = wait_until(
            lambda: outcome(fleet, "node-a"), args.deadline + 15, "node-a's outcome", 0.2
        )
        empty_after = (
            next(
                e["wall_time"]
                for e in fleet.call(lambda c: c.admin.events(node="node-a"))
                if e["kind"] == "verified_empty"
            )
            - paused_at
        )
        print()
        print(subprocess_text([*spotctl, "timeline", answer.get("reclaim_id", "")]))
        print()
        for name, c in containers.items():
            c.reload()
            say(f"node-a {name}: {c.status}, exit code {c.attrs['State']['ExitCode']}")
        manifests = sorted((work / "bucket" / "manifests").glob("gen-*.json"))
        ckpt_ok = bool(manifests)
        if manifests:
            newest = json.loads(manifests[-1].read_bytes())
            say(
                f"ckpt's bucket: generation {newest['generation']} committed, "
                f"{newest['bytes']} bytes in {len(newest['objects'])} objects (manifest last)"
            )
        else:
            say("ckpt's bucket holds no committed generation")
        say_long_answer(fleet, long_answer)
        ended = alices()
        say(
            f"alice's rental: {ended.state}, ended by {ended.ended_by or '-'}, "
            f"{(ended.ended_at or 0) - told.reclaim_at:+.2f} s from reclaim_at"
        )
        say(f"node-a verified empty {empty_after:.1f} s after the pause; outcome {result_a}")
        print(subprocess_text([*spotctl, "reputation", "node-a"]))
        act1 = (traffic.completed, traffic.interrupted, traffic.refused, traffic.failed)

        # --- act 2: the provider reclaims node-b ------------------------------------------
        print()
        say("ACT 2: the provider gives node-b a hard notice")
        noticed = time.time()
        terminate_at = noticed + args.deadline
        agents["node-b"].write_notice(
            {
                "id": f"i-demo-{int(terminate_at)}",
                "action": "terminate",
                "terminate_at": terminate_at,
                "source": "demo-relay",
            }
        )
        wait_until(acquired.exists, 10, "the acquirer to be asked")
        asked = json.loads(acquired.read_text().splitlines()[0])
        say(
            f"group {asked['request']['target_group']}'s acquirer asked "
            f"{asked['at'] - noticed:.2f} s after the notice, for {asked['request']['models']}; "
            f"group spot-a is avoided for new placements"
        )
        result_b = wait_until(
            lambda: outcome(fleet, "node-b"), args.deadline + 15, "node-b's outcome", 0.2
        )
        wait_until(lambda: ready(2), 60, "the model back at two ready workers", every=0.2)
        time.sleep(1.0)
        traffic.close()
        print()
        print(subprocess_text([*spotctl, "timeline"]))
        print()
        print(subprocess_text([*spotctl, "nodes"]))
        print(subprocess_text([*spotctl, "models", "list"]))
        stats = json.loads(urllib.request.urlopen(router.url + "/stats", timeout=10).read())
        say(
            f"clients, act 1 (pause of node-a): {act1[0]} completed, {act1[1]} interrupted, "
            f"{act1[2]} refused, {act1[3]} failed"
        )
        say(
            f"clients, in all: {traffic.completed} completed, {traffic.interrupted} "
            f"interrupted, {traffic.refused} refused (no worker), {traffic.failed} failed"
        )
        say(f"router: {stats}")
        say(
            f"outcomes: node-a {result_a}, node-b {result_b}; alice's rental ended by "
            f"{ended.ended_by}"
        )
        slurm_ok = True
        if args.slurm:
            print()
            leader = fleet.replicas[fleet.leader()]
            slurm_ok = slurm_act(work / "slurm", coord, leader, lib, args.deadline, grace, say)
            say(f"Slurm act: {'drained, and the job resumed elsewhere' if slurm_ok else 'FAILED'}")
        ok = (
            slurm_ok
            and result_a == "drained"
            and result_b == "drained"
            and act1[1] == 0
            and ckpt_ok
            and act1[3] == 0
            and traffic.failed == 0
            and ended.ended_by == "reclaim"
        )
        if failover is not None:
            old, new, took_s = failover
            term, holder = lease_term(db)
            wrong = steps_not_once(fleet, answer.get("reclaim_id", ""))
            say(
                f"failover: replica {old} SIGKILLed in act 1, replica {new} led {took_s:.2f} s "
                f"later; replica {fleet.leader()} leads now, at term {term} ({holder}); node-a's "
                f"steps each stored once: {'yes' if not wrong else wrong}"
            )
            ok = ok and fleet.leader() == new and holder == replicas[new].address and not wrong
        return 0 if ok else 1
    finally:
        if traffic is not None:
            traffic.close()
        for proc in reversed(started):
            proc.stop()
        if postgres is not None:
            postgres.stop()
        if engine is not None:
            for prefix in (PREFIX, "spotdrain-w-", "spotdrain-rental-"):
                remove_test_containers(engine.client, prefix)
            engine.stop()
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def run_checkpoint_job(client, image: str, agent, name: str, bucket: Path, state_mb: float):
    """The reference job as a batch container of node-a, mounted the way the agent mounts the
    jobs it starts: the deadline file's directory read-only, its status directory read-write,
    and its bucket."""
    bucket.mkdir(parents=True, exist_ok=True)
    agent.deadline_file.parent.mkdir(parents=True, exist_ok=True)
    mounts = [
        docker.types.Mount(
            CONTAINER_DEADLINE_DIR, str(agent.deadline_file.parent), type="bind", read_only=True
        ),
        docker.types.Mount(CONTAINER_STATUS_DIR, str(agent.status_dir(name)), type="bind"),
        docker.types.Mount("/bucket", str(bucket), type="bind"),
    ]
    env = {
        DEADLINE_FILE_ENV: f"{CONTAINER_DEADLINE_DIR}/{agent.deadline_file.name}",
        STATUS_DIR_ENV: CONTAINER_STATUS_DIR,
        "CHECKPOINT_BUCKET": "/bucket",
        "CHECKPOINT_STATE_MB": str(state_mb),
    }
    c = client.containers.run(
        image,
        name=name,
        environment=env,
        mounts=mounts,
        labels={NODE_LABEL: agent.node_id, KIND_LABEL: "batch"},
        network_mode="none",
        detach=True,
    )
    wait_until(
        lambda: b"job: ready" in c.logs() or c.reload() or c.status == "exited",
        120,
        f"{name} to be ready",
    )
    if b"job: ready" not in c.logs():
        raise RuntimeError(f"{name} did not start: {c.logs().decode(errors='replace')}")
    return c


def kill_the_leader(fleet: Coordinators, db: str, at: float, paused_at: float):  # noqa: ANN201
    """SIGKILL the leader at wall time `at`; (its name, the next leader's, seconds from the
    kill to the next leader serving)."""
    time.sleep(max(0.0, at - time.time()))
    old = fleet.leader()
    killed, killed_wall = time.monotonic(), time.time()
    fleet.replicas[old].proc.kill()
    say(
        f"SIGKILL the leader, replica {old} ({fleet.replicas[old].address}), "
        f"{killed_wall - paused_at:.1f} s after the pause, mid-drain"
    )
    new = fleet.leader(timeout=30)
    took_s = time.monotonic() - killed
    term, _ = lease_term(db)
    say(
        f"replica {new} ({fleet.replicas[new].address}) leads at term {term}, "
        f"{took_s:.2f} s after the SIGKILL; agents, the router and spotctl follow it"
    )
    return old, new, took_s


def outcome(fleet: Coordinators, node: str) -> str | None:
    kinds = fleet.call(lambda c: c.admin.kinds(node=node))
    return "drained" if "drained" in kinds else "overrun" if "overrun" in kinds else None


def subprocess_json(argv: list[str]) -> dict:
    return json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout)


def subprocess_text(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout


if __name__ == "__main__":
    sys.exit(main())
