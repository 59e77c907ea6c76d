"""Workload contracts (coordinator/capacity/contracts.py): per image, how its reclamations ended,
from the agents' own events, stored on each backend; an image that keeps failing is flagged once
and, with --no-spot-for-flagged, kept off spot nodes by the one placement gate.

The in-process stories use a real store and a fake clock; each reclamation is the events an
agent sends for it (notice_received, sigterm_sent with the container's image, then
container_exited before G, a SIGKILL at G, or an overrun at O)."""

from __future__ import annotations

import asyncio
import json
import subprocess

import grpc
import pytest

from fakes.fakenode import FakeNode, Ops
from fakes.harness import BIN, start_coordinator
from fakes.waiting import eventually
from spotdrain.coordinator.api.admin import AdminServicer
from spotdrain.coordinator.api.agent_link import Coordinator
from spotdrain.coordinator.capacity.contracts import ContractPolicy
from spotdrain.coordinator.core.admission import CONTRACT_FLAGGED, NodeView, PlacementRequest, admit
from spotdrain.coordinator.store import NewEvent, open_store
from spotdrain.v1 import spotdrain_pb2 as pb

IMAGE = "registry.example/trainer:7"


class FakeClock:
    def __init__(self, now: float = 5_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def reclamation(
    n: int, end: str, image: str = IMAGE, node: str = "node-a", kind: str = "batch"
) -> list[tuple]:
    """The agent's events for reclamation `n` of one container, as
    (kind, reclaim_id, wall_time, details)."""
    t0 = 10_000.0 + n * 200
    d, g, o = t0 + 120, t0 + 110, t0 + 118
    rid, cid, name = f"rcl-{node}-{n:05d}", f"c{n:063d}", f"job-{n}"
    out = [
        (
            "notice_received",
            rid,
            t0,
            {"t0": t0, "terminate_at": d, "grace_deadline": g, "overrun_at": o, "reason": "notice"},
        ),
        (
            "sigterm_sent",
            rid,
            t0 + 0.05,
            {"container": cid, "name": name, "via": "api", "image": image, "kind": kind},
        ),
    ]
    if end == "exited":
        out.append(
            ("container_exited", rid, t0 + 31, {"container": cid, "name": name, "exit_code": 0})
        )
    elif end == "killed":
        out += [
            ("sigkill_sent", rid, g, {"container": cid, "name": name, "via": "api"}),
            ("container_exited", rid, g + 0.2, {"container": cid, "name": name, "exit_code": 137}),
        ]
    else:
        out += [
            ("sigkill_sent", rid, g, {"container": cid, "name": name, "via": "api"}),
            ("overrun", rid, o, {"still_running": [name], "last_failure": ""}),
            ("container_exited", rid, o + 1.5, {"container": cid, "name": name, "exit_code": 137}),
        ]
    return out


def as_new(node: str, rows: list[tuple]) -> list[NewEvent]:
    return [
        NewEvent(
            uid=f"{node}-{rid}-{i}-{kind}",
            kind=kind,
            node_id=node,
            reclaim_id=rid,
            wall_time=wall,
            t_offset_s=None,
            details=details,
        )
        for i, (kind, rid, wall, details) in enumerate(rows)
    ]


@pytest.fixture
async def store(store_url):
    s = await open_store(store_url, clock=FakeClock())
    yield s
    await s.close()


async def coordinator_on(store, policy: ContractPolicy | None = None) -> Coordinator:
    coord = Coordinator(store, insecure=True, clock=FakeClock(), contract_policy=policy)
    await coord.fleet.recovery.rebuild()
    return coord


async def flagged_events(store) -> list[dict]:
    return [
        json.loads(e.details_json)
        for e in await store.events_after(0, 100_000)
        if e.kind == "workload_contract_flagged"
    ]


async def test_two_overruns_in_forty_flag_the_image_once(store):
    """An image overruns 2 of its 40 reclamations (the 6th and the 31st). Before 20 it is not
    judged; at the 20th (1 overrun in 20: 5 %, past the 0.5 % budget) it is flagged, once, with
    the counts of that moment. The second overrun, a resent batch and a restarted coordinator
    flag nothing more; the counts go on."""
    coord = await coordinator_on(store)
    ends = ["overrun" if n in (5, 30) else "exited" for n in range(40)]
    for n in range(19):
        await coord.events.accept(as_new("node-a", reclamation(n, ends[n])))
    assert await flagged_events(store) == []
    assert not coord.fleet.contracts.flagged(IMAGE, "batch")
    for n in range(19, 40):
        await coord.events.accept(as_new("node-a", reclamation(n, ends[n])))
    assert await flagged_events(store) == [
        {
            "image": IMAGE,
            "kind": "batch",
            "exited": 19,
            "killed": 0,
            "overrun": 1,
            "reclamations": 20,
            "share": 0.05,
            "budget": 0.005,
        }
    ]
    assert coord.fleet.contracts.flagged(IMAGE, "batch")
    await coord.events.accept(as_new("node-a", reclamation(30, "overrun")))  # resent: once
    (row,) = await store.contracts()
    assert (row.exited, row.killed, row.overrun, row.flagged_at) == (38, 0, 2, 5_000.0)
    again = await coordinator_on(store)
    assert again.fleet.contracts.flagged(IMAGE, "batch")
    await again.events.accept(as_new("node-a", reclamation(40, "killed")))
    assert len(await flagged_events(store)) == 1
    assert ([IMAGE, "batch", "overrun"], 2.0) in again.fleet.contracts.samples()
    assert ([IMAGE, "batch", "killed"], 1.0) in again.fleet.contracts.samples()
    assert again.fleet.contracts.flagged_samples() == [([IMAGE, "batch"], 1.0)]


async def test_listing_the_contracts_changes_nothing(store):
    """Another coordinator on the same store (the leader before a failover) took 40
    reclamations of the image, two of them overruns, and flagged it; this one rebuilt before
    that, so its gate and its metrics still go by the clean image. An operator lists the
    contracts: the answer is what the store holds (40, flagged), and the listing changed
    nothing: not the stored events or counts, not what this coordinator's gate and metrics go
    by. Those catch up where the counts change: the next reclamation this coordinator stores."""
    coord = await coordinator_on(store)
    leader = await coordinator_on(store)
    for n in range(40):
        end = "overrun" if n in (5, 30) else "exited"
        await leader.events.accept(as_new("node-a", reclamation(n, end)))
    contracts = coord.fleet.contracts

    async def state() -> tuple:
        events = await store.events_after(0, 100_000)
        return (
            len(events),
            await store.contracts(),
            contracts.samples(),
            contracts.flagged_samples(),
            contracts.flagged(IMAGE, "batch"),
        )

    before = await state()
    reply = await AdminServicer(coord).ListWorkloadContracts(
        pb.ListWorkloadContractsRequest(),
        None,  # an insecure coordinator reads no identity from the call
    )
    assert [(c.image, c.reclamations, c.overrun, c.flagged) for c in reply.contracts] == [
        (IMAGE, 40, 2, True)
    ]
    report = await coord.ops.contracts()
    assert [(r.reclamations, r.flagged_at) for r in report.rows] == [(40, 5_000.0)]
    assert await state() == before
    assert not contracts.flagged(IMAGE, "batch") and contracts.samples() == []
    await coord.events.accept(as_new("node-a", reclamation(40, "exited")))
    assert contracts.flagged(IMAGE, "batch")
    assert ([IMAGE, "batch", "exited"], 39.0) in contracts.samples()


async def test_a_thousand_clean_reclamations_flag_nothing(store):
    coord = await coordinator_on(store)
    for start in range(0, 1000, 100):
        rows = [r for n in range(start, start + 100) for r in reclamation(n, "exited")]
        await coord.events.accept(as_new("node-a", rows))
    (row,) = await store.contracts()
    assert (row.exited, row.killed, row.overrun, row.flagged_at) == (1000, 0, 0, None)
    assert await flagged_events(store) == []
    assert coord.fleet.contracts.flagged_samples() == [([IMAGE, "batch"], 0.0)]


async def test_below_the_minimum_nothing_is_judged_and_kills_count_like_overruns(store):
    """One kill in 19 is 5 %, but 19 reclamations say too little: not flagged. The 20th
    reclamation (clean) makes it judged, and 1 of 20 killed is past the budget."""
    coord = await coordinator_on(store)
    await coord.events.accept(as_new("node-a", reclamation(0, "killed")))
    for n in range(1, 19):
        await coord.events.accept(as_new("node-a", reclamation(n, "exited")))
    assert await flagged_events(store) == []
    await coord.events.accept(as_new("node-a", reclamation(19, "exited")))
    (flag,) = await flagged_events(store)
    assert (flag["killed"], flag["overrun"], flag["reclamations"]) == (1, 0, 20)


async def test_images_and_kinds_are_counted_apart_and_rentals_not_at_all(store):
    coord = await coordinator_on(store)
    await coord.events.accept(as_new("node-a", reclamation(0, "exited", image="a:1")))
    await coord.events.accept(as_new("node-a", reclamation(1, "killed", image="b:1")))
    await coord.events.accept(
        as_new("node-a", reclamation(2, "killed", image="a:1", kind="render"))
    )
    # A rental is never SIGTERMed: its SIGKILL at G (its reclaim_at) counts against nothing.
    rows = [r for r in reclamation(3, "killed", image="rent:1") if r[0] != "sigterm_sent"]
    await coord.events.accept(as_new("node-a", rows))
    got = {(r.image, r.kind): (r.exited, r.killed, r.overrun) for r in await store.contracts()}
    assert got == {
        ("a:1", "batch"): (1, 0, 0),
        ("a:1", "render"): (0, 1, 0),
        ("b:1", "batch"): (0, 1, 0),
    }


async def test_another_nodes_events_cannot_end_a_container_it_does_not_own(store):
    coord = await coordinator_on(store)
    rows = reclamation(0, "exited")
    await coord.events.accept(as_new("node-a", rows[:2]))
    await coord.events.accept(as_new("node-b", [("container_exited", rows[0][1], 1.0, rows[2][3])]))
    assert [(r.exited, r.killed) for r in await store.contracts()] == []


@pytest.mark.parametrize(
    ("budget", "minimum"), [(float("nan"), 20), (1.0, 20), (-0.1, 20), (0.005, 0)]
)
def test_a_bad_policy_is_refused(budget, minimum):
    with pytest.raises(ValueError, match="contract"):
        ContractPolicy(budget, minimum)


def test_the_gate_rule_keeps_a_flagged_image_off_spot_only():
    node = dict(workload_enabled=True, tainted=False, connected=True, gpus_total=2, gpus_in_use=0)
    spot, ondemand = NodeView("s", spot=True, **node), NodeView("o", spot=False, **node)
    off = PlacementRequest(kind="batch", off_spot=True)
    assert admit(spot, off) == CONTRACT_FLAGGED
    assert admit(ondemand, off) is None
    assert admit(spot, PlacementRequest(kind="batch")) is None


# --- end to end: a coordinator process, fake agents, spotctl -----------------------------------


async def send(node: FakeNode, rows: list[tuple]) -> None:
    events = [
        pb.Event(
            uid=f"{node.node_id}-{rid}-{i}",
            kind=kind,
            node_id=node.node_id,
            reclaim_id=rid,
            wall_time=wall,
            details_json=json.dumps(details),
        )
        for i, (kind, rid, wall, details) in enumerate(rows)
    ]
    await node.outgoing.put(pb.AgentMessage(events=pb.EventBatch(events=events)))


async def spotctl(coord, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        str(BIN / "spotctl"), *coord.cli_args(), *args, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0
    return out.decode()


async def test_no_spot_for_flagged_through_the_gate_and_spotctl(tmp_path, pki):
    """A coordinator run with --no-spot-for-flagged --contract-min 20. Spot node A reports 40
    reclamations of the trainer image, two of them overruns: the image is flagged, `spotctl
    workloads` says so, and the gate then refuses that image on spot node A (recorded with the
    reason) while on-demand node B takes it, and another image still goes on A."""
    coord = start_coordinator(
        tmp_path / "c", tls=pki, extra=("--no-spot-for-flagged", "--contract-min", "20")
    )
    a = FakeNode(coord, pki, "node-a", spot=True)
    b = FakeNode(coord, pki, "node-b", spot=False)
    ops = Ops(coord)
    try:
        await a.connect()
        await b.connect()
        rows = [
            r for n in range(40) for r in reclamation(n, "overrun" if n in (7, 30) else "exited")
        ]
        for i in range(0, len(rows), 60):
            await send(a, rows[i : i + 60])
        # Flagged at the 20th reclamation already; wait until all 40 are stored.
        await eventually(
            lambda: ops.admin.ListWorkloadContracts(pb.ListWorkloadContractsRequest()),
            ok=lambda got: [c.reclamations for c in got.contracts] == [40],
        )
        assert len(await ops.events("workload_contract_flagged")) == 1
        out = await spotctl(coord, "workloads", "--json")
        doc = json.loads(out)
        assert doc["no_spot_for_flagged"] is True and doc["min_reclamations"] == 20
        (w,) = doc["workloads"]
        assert (w["image"], w["kind"], w["exited"], w["overrun"], w["flagged"]) == (
            IMAGE,
            "batch",
            38,
            2,
            True,
        )
        assert w["share"] == pytest.approx(0.05)
        table = await spotctl(coord, "workloads")
        assert IMAGE in table and "FLAGGED" in table and "5.00%" in table

        def start(node: str, image: str):
            return ops.admin.StartWorker(
                pb.StartWorkerRequest(
                    node_id=node, model="trainer", image=image, slots=1, kind="batch"
                )
            )

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await start("node-a", IMAGE)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert CONTRACT_FLAGGED in err.value.details()
        refused = [json.loads(e.event.details_json) for e in await ops.events("placement_refused")]
        assert [(r["reason"], r["image"]) for r in refused] == [(CONTRACT_FLAGGED, IMAGE)]
        assert (await start("node-b", IMAGE)).node_id == "node-b"
        assert (await start("node-a", "registry.example/other:1")).node_id == "node-a"
    finally:
        await a.close()
        await b.close()
        await ops.channel.close()
        coord.proc.stop()


def test_the_coordinator_refuses_a_bad_budget(tmp_path):
    proc = subprocess.run(
        [
            str(BIN / "spotdrain-coordinator"),
            "--listen",
            "127.0.0.1:0",
            "--db",
            str(tmp_path / "c.sqlite"),
            "--insecure",
            "--contract-budget",
            "nan",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "--contract-budget" in proc.stderr
    assert not (tmp_path / "c.sqlite").exists()
