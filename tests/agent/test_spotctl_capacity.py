"""spotctl's capacity commands (nodes, the spot flag, rentals, reputation, models, worker kinds)
against a fake coordinator: a real gRPC server on port 0 whose Admin and Rentals servicers return
canned messages and record every request. Each scenario checks the request spotctl sent, what it
printed, and its exit code; a refusal is one stderr line and exit 1, a bad word exit 2 before
any call."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from spotdrain.agent.spotctl import main as ctl
from spotdrain.agent.spotctl import render
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z
FORMULA = "score = (successes + 4) / (successes + failures + 5)"


@dataclass
class FakeCoordinator:
    """What the servicers answer (`replies[method]`; a list for WatchRental's stream), which
    methods refuse (`refusals[method]`: FAILED_PRECONDITION with that message) and what came in."""

    address: str = ""
    replies: dict[str, Any] = field(default_factory=dict)
    refusals: dict[str, str] = field(default_factory=dict)
    calls: list[tuple[str, Message]] = field(default_factory=list)

    async def answer(self, method: str, request: Message, context: Any) -> Any:
        self.calls.append((method, request))
        if method in self.refusals:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.refusals[method])
        return self.replies[method]


class FakeAdmin(pb_grpc.AdminServicer):
    def __init__(self, fake: FakeCoordinator) -> None:
        self.fake = fake

    async def ListNodes(self, request, context):
        return await self.fake.answer("ListNodes", request, context)

    async def SetNodeSpot(self, request, context):
        return await self.fake.answer("SetNodeSpot", request, context)

    async def GetReputation(self, request, context):
        return await self.fake.answer("GetReputation", request, context)

    async def ListModels(self, request, context):
        return await self.fake.answer("ListModels", request, context)

    async def SetModelReplicas(self, request, context):
        return await self.fake.answer("SetModelReplicas", request, context)

    async def StartWorker(self, request, context):
        return await self.fake.answer("StartWorker", request, context)


class FakeRentals(pb_grpc.RentalsServicer):
    def __init__(self, fake: FakeCoordinator) -> None:
        self.fake = fake

    async def CreateRental(self, request, context):
        return await self.fake.answer("CreateRental", request, context)

    async def GetRental(self, request, context):
        return await self.fake.answer("GetRental", request, context)

    async def EndRental(self, request, context):
        return await self.fake.answer("EndRental", request, context)

    async def ListRentals(self, request, context):
        return await self.fake.answer("ListRentals", request, context)

    async def WatchRental(self, request, context):
        for update in await self.fake.answer("WatchRental", request, context):
            yield update


@pytest.fixture
async def coordinator() -> AsyncIterator[FakeCoordinator]:
    fake = FakeCoordinator()
    server = grpc.aio.server()
    pb_grpc.add_AdminServicer_to_server(FakeAdmin(fake), server)
    pb_grpc.add_RentalsServicer_to_server(FakeRentals(fake), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    fake.address = f"127.0.0.1:{port}"
    yield fake
    await server.stop(0)


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.out.splitlines()]


@pytest.fixture
def spotctl(coordinator, capsys):
    """Run spotctl's main() as an operator would, against the fake. main() owns its event loop
    (asyncio.run), so it runs in a thread while this test's loop serves the fake."""

    def main(argv: list[str]) -> int:
        # SystemExit (argparse's usage errors) must not cross into asyncio: it stops the loop.
        try:
            return ctl.main(["--coordinator", coordinator.address, "--insecure", *argv])
        except SystemExit as e:
            return e.code

    async def invoke(*argv: str) -> Result:
        capsys.readouterr()
        code = await asyncio.wait_for(asyncio.to_thread(main, list(argv)), 10)
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return invoke


def node(node_id: str, **kw: Any) -> pb.Node:
    defaults = dict(connected=True, workload_enabled=True, node_group="eu-west-a", provider="acme")
    return pb.Node(node_id=node_id, **{**defaults, **kw})


def rental(rental_id: str = "rnt-1", **kw: Any) -> pb.Rental:
    defaults = dict(
        node_id="node-a",
        provider="acme",
        renter="bob",
        image="img:1",
        gpus=2,
        state="running",
        started_at=T0,
    )
    return pb.Rental(rental_id=rental_id, **{**defaults, **kw})


def only_call(fake: FakeCoordinator) -> tuple[str, Message]:
    assert len(fake.calls) == 1, fake.calls
    return fake.calls[0]


# --- nodes and the spot flag -------------------------------------------------------------------


async def test_nodes_table_shows_flags_taints_load_and_an_avoided_group(coordinator, spotctl):
    """An operator looks over the fleet: node-a is a spot node under a notice taint in a group the
    placer avoids for a while, draining Docker and Slurm (node gpu-017 of cluster west), an AWS
    spot g5.xlarge in us-east-1a; node-b is on-demand, paused by its owner and disconnected, and
    never said what cloud instance it is."""
    avoided = time.time() + 600
    coordinator.replies["ListNodes"] = pb.ListNodesReply(
        nodes=[
            node(
                "node-a",
                spot=True,
                live_workers=2,
                active_rentals=1,
                taints=[pb.Taint(key="spotdrain/reclaim", reason="notice", reclaim_id="rcl-1")],
                group_avoided_until=avoided,
                managers=[
                    pb.WorkManager(name="docker"),
                    pb.WorkManager(name="slurm", node_name="gpu-017", cluster="west"),
                ],
                cloud=AWS_SPOT,
            ),
            node("node-b", node_group="", provider="", workload_enabled=False, connected=False),
        ]
    )
    result = await spotctl("nodes")
    assert result.code == 0 and result.err == ""
    assert only_call(coordinator) == ("ListNodes", pb.ListNodesRequest())
    header, a, b = result.out.splitlines()
    assert header.split() == [
        "node",
        "mode",
        "group",
        "provider",
        "workload",
        "workers",
        "rentals",
        "connected",
        "managers",
        "cloud",
        "taints",
    ]
    assert a.split()[:11] == [
        "node-a",
        "spot",
        "eu-west-a",
        "acme",
        "enabled",
        "2",
        "1",
        "yes",
        "docker,slurm:west/gpu-017",
        "aws/us-east-1a/g5.xlarge/spot",
        "notice",
    ]
    assert f"group avoided until {render.iso(avoided)} (in " in a
    assert b.split() == ["node-b", "on-demand", "-", "-", "disabled", "0", "0", "no", "-", "-", "-"]


AWS_SPOT = pb.CloudIdentity(
    provider="aws",
    instance_id="i-0123456789abcdef0",
    region="us-east-1",
    zone="us-east-1a",
    instance_type="g5.xlarge",
    spot=True,
)


async def test_nodes_table_names_each_clouds_place_in_one_word(coordinator, spotctl):
    """Azure writes its zone as a bare number: the column puts the region before it. A node whose
    provider gave no zone shows its region; an on-demand Google VM says so."""
    coordinator.replies["ListNodes"] = pb.ListNodesReply(
        nodes=[
            node(
                "node-a",
                cloud=pb.CloudIdentity(
                    provider="azure",
                    region="westeurope",
                    zone="1",
                    instance_type="Standard_NC6s_v3",
                    spot=True,
                ),
            ),
            node(
                "node-b",
                cloud=pb.CloudIdentity(
                    provider="azure", region="eastus", instance_type="Standard_D2s_v5"
                ),
            ),
            node(
                "node-c",
                cloud=pb.CloudIdentity(
                    provider="gcp",
                    region="us-central1",
                    zone="us-central1-a",
                    instance_type="g2-standard-4",
                ),
            ),
        ]
    )
    result = await spotctl("nodes")
    assert [line.split()[9] for line in result.out.splitlines()[1:]] == [
        "azure/westeurope-1/Standard_NC6s_v3/spot",
        "azure/eastus/Standard_D2s_v5/on-demand",
        "gcp/us-central1-a/g2-standard-4/on-demand",
    ]


async def test_nodes_json_is_one_object_a_line_with_the_proto_field_names(coordinator, spotctl):
    coordinator.replies["ListNodes"] = pb.ListNodesReply(
        nodes=[
            node("node-a", spot=True, active_rentals=1, cloud=AWS_SPOT),
            node("node-b", managers=[pb.WorkManager(name="slurm", node_name="b")]),
        ]
    )
    result = await spotctl("nodes", "--json")
    assert result.code == 0
    docs = result.json_lines()
    assert [d["node_id"] for d in docs] == ["node-a", "node-b"]
    assert docs[0]["spot"] is True and docs[1]["spot"] is False
    assert docs[0]["active_rentals"] == 1 and docs[1]["live_workers"] == 0
    assert docs[0]["taints"] == [] and docs[0]["group_avoided_until"] == 0
    assert docs[0]["managers"] == []
    # A Slurm node whose cluster the agent could not read: the field is there, empty.
    assert docs[1]["managers"] == [{"name": "slurm", "node_name": "b", "cluster": ""}]
    assert docs[0]["cloud"] == {
        "provider": "aws",
        "instance_id": "i-0123456789abcdef0",
        "region": "us-east-1",
        "zone": "us-east-1a",
        "instance_type": "g5.xlarge",
        "spot": True,
    }
    assert "cloud" not in docs[1]  # never reported: absent, not an empty identity


@pytest.mark.parametrize("word, spot", [("true", True), ("false", False)])
async def test_set_spot_sends_the_flag_and_shows_the_node(coordinator, spotctl, word, spot):
    coordinator.replies["SetNodeSpot"] = node("node-a", spot=spot)
    result = await spotctl("node", "set-spot", "node-a", word)
    assert result.code == 0
    assert only_call(coordinator) == (
        "SetNodeSpot",
        pb.SetNodeSpotRequest(node_id="node-a", spot=spot),
    )
    assert result.out.splitlines()[1].split()[:2] == ["node-a", "spot" if spot else "on-demand"]
    as_json = await spotctl("node", "set-spot", "node-a", word, "--json")
    assert as_json.json_lines() == [ctl.message_doc(node("node-a", spot=spot))]


@pytest.mark.parametrize("word", ["maybe", "True", "1", "yes"])
async def test_set_spot_takes_only_true_or_false(coordinator, spotctl, word):
    """A typo must not flip a node: anything but the words true/false is a usage error, and
    nothing reaches the coordinator."""
    result = await spotctl("node", "set-spot", "node-a", word)
    assert result.code == 2 and result.out == ""
    assert result.err.startswith("spotctl node set-spot: error: argument spot: invalid choice")
    assert len(result.err.strip().splitlines()) == 1
    assert coordinator.calls == []


async def test_set_spot_mid_rental_is_refused_with_the_coordinators_reason(coordinator, spotctl):
    """A provider tries to switch a node to spot while a renter is on it (docs/design.md,
    invariant 9): the coordinator refuses, and spotctl says why in one line and exits 1."""
    coordinator.refusals["SetNodeSpot"] = "node-a has an active rental (rnt-1)"
    result = await spotctl("node", "set-spot", "node-a", "true")
    assert result.code == 1 and result.out == ""
    assert result.err == (
        f"spotctl: coordinator {coordinator.address}: FAILED_PRECONDITION: "
        "node-a has an active rental (rnt-1)\n"
    )
    assert only_call(coordinator)[0] == "SetNodeSpot"


# --- rentals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, request_",
    [
        (["rentals"], pb.ListRentalsRequest()),
        (["rentals", "list"], pb.ListRentalsRequest()),
        (["rentals", "--active"], pb.ListRentalsRequest(active_only=True)),
        (
            ["rentals", "list", "--node", "node-a", "--active"],
            pb.ListRentalsRequest(node_id="node-a", active_only=True),
        ),
        (["rentals", "--node", "node-b", "list"], pb.ListRentalsRequest(node_id="node-b")),
    ],
)
async def test_rentals_list_is_the_default_and_passes_its_filters(
    coordinator, spotctl, argv, request_
):
    coordinator.replies["ListRentals"] = pb.ListRentalsReply()
    result = await spotctl(*argv)
    assert result.code == 0
    assert only_call(coordinator) == ("ListRentals", request_)
    assert result.out.split()[:3] == ["rental", "node", "state"]


async def test_rentals_list_shows_a_coming_reclaim_and_an_end(coordinator, spotctl):
    reclaim_at = time.time() + 90
    coordinator.replies["ListRentals"] = pb.ListRentalsReply(
        rentals=[
            rental("rnt-1", reclaim_at=reclaim_at, reclaim_id="rcl-7", reclaim_reason="notice"),
            rental("rnt-2", state="ended", ended_at=T0 + 60, ended_by="renter", exit_code=0),
        ]
    )
    result = await spotctl("rentals")
    _, first, second = result.out.splitlines()
    assert first.split()[:6] == ["rnt-1", "node-a", "running", "bob", "2", "on-demand"]
    assert re.search(
        rf"RECLAIM at {re.escape(render.iso(reclaim_at))} \(in (8\d|90)\.\d s\): notice rcl-7$",
        first,
    )
    assert second.endswith("ended 2023-11-14T22:14:20.000Z by renter, exit code 0")
    as_json = await spotctl("rentals", "--json")
    docs = as_json.json_lines()
    assert [d["rental_id"] for d in docs] == ["rnt-1", "rnt-2"]
    assert docs[0]["reclaim_at"] == reclaim_at and "ended_at" not in docs[0]
    assert docs[1]["ended_at"] == T0 + 60 and docs[1]["exit_code"] == 0


async def test_create_rental_sends_the_request_and_shows_the_rental(coordinator, spotctl):
    coordinator.replies["CreateRental"] = rental(state="starting", started_at=0)
    result = await spotctl(
        "rentals", "create", "node-a", "--image", "img:1", "--gpus", "2", "--renter", "bob"
    )
    assert result.code == 0
    assert only_call(coordinator) == (
        "CreateRental",
        pb.CreateRentalRequest(node_id="node-a", image="img:1", gpus=2, renter="bob"),
    )
    assert result.out.splitlines() == [
        "rental rnt-1 on node-a (provider acme, on-demand at start): starting",
        "  renter bob  image img:1  gpus 2  started -",
    ]


async def test_create_rental_defaults_to_one_gpu_and_json_leaves_unset_optionals_out(
    coordinator, spotctl
):
    coordinator.replies["CreateRental"] = rental()
    result = await spotctl("rentals", "create", "node-a", "--image", "img:1", "--json")
    assert only_call(coordinator)[1] == pb.CreateRentalRequest(
        node_id="node-a", image="img:1", gpus=1
    )
    (doc,) = result.json_lines()
    assert doc == {
        "rental_id": "rnt-1",
        "node_id": "node-a",
        "provider": "acme",
        "renter": "bob",
        "image": "img:1",
        "gpus": 2,
        "state": "running",
        "started_at": T0,
        "ended_by": "",
        "started_on_spot": False,
        "reclaim_id": "",
        "reclaim_reason": "",
        "detail": "",
    }


async def test_create_rental_refused_by_the_placement_gate(coordinator, spotctl):
    coordinator.refusals["CreateRental"] = "node-a is paused by its owner"
    result = await spotctl("rentals", "create", "node-a", "--image", "img:1")
    assert result.code == 1 and result.out == ""
    assert result.err.strip().endswith("FAILED_PRECONDITION: node-a is paused by its owner")


async def test_get_rental_shows_the_reclaim_prominently(coordinator, spotctl):
    """A renter's rental on a node whose owner paused it: the time its container stops is the
    line to read first, as an absolute time and as seconds from now."""
    reclaim_at = time.time() + 30
    coordinator.replies["GetRental"] = rental(
        started_on_spot=True, reclaim_at=reclaim_at, reclaim_id="rcl-2", reclaim_reason="pause"
    )
    result = await spotctl("rentals", "get", "rnt-1")
    assert only_call(coordinator) == ("GetRental", pb.GetRentalRequest(rental_id="rnt-1"))
    lines = result.out.splitlines()
    assert lines[0] == "rental rnt-1 on node-a (provider acme, spot at start): running"
    assert re.fullmatch(
        rf"  RECLAIM at {re.escape(render.iso(reclaim_at))} \(in (2\d|30)\.\d s\): pause rcl-2",
        lines[2],
    )


def test_render_rental_is_exact_for_a_fixed_clock():
    r = rental(
        state="ended",
        reclaim_at=T0 + 120,
        reclaim_id="rcl-3",
        reclaim_reason="notice",
        ended_at=T0 + 121,
        ended_by="reclaim",
        exit_code=137,
        detail="stopped at G",
    )
    assert ctl.render_rental(r, now=T0 + 100.1).splitlines() == [
        "rental rnt-1 on node-a (provider acme, on-demand at start): ended",
        "  renter bob  image img:1  gpus 2  started 2023-11-14T22:13:20.000Z",
        "  RECLAIM at 2023-11-14T22:15:20.000Z (in 19.9 s): notice rcl-3",
        "  ended 2023-11-14T22:15:21.000Z by reclaim, exit code 137",
        "  detail: stopped at G",
    ]
    assert "(5.0 s ago)" in ctl.render_rental(r, now=T0 + 125)


@pytest.mark.parametrize("by", ["renter", "provider", "platform"])
async def test_end_rental_says_who_ended_it(coordinator, spotctl, by):
    coordinator.replies["EndRental"] = rental(state="ended", ended_at=T0 + 5, ended_by=by)
    result = await spotctl("rentals", "end", "rnt-1", "--ended-by", by, "--json")
    assert only_call(coordinator) == (
        "EndRental",
        pb.EndRentalRequest(rental_id="rnt-1", ended_by=by),
    )
    (doc,) = result.json_lines()
    assert doc["ended_by"] == by and doc["ended_at"] == T0 + 5


async def test_end_rental_without_ended_by_leaves_it_to_the_coordinator(coordinator, spotctl):
    coordinator.replies["EndRental"] = rental(state="ended", ended_at=T0, ended_by="platform")
    result = await spotctl("rentals", "end", "rnt-1")
    assert only_call(coordinator)[1] == pb.EndRentalRequest(rental_id="rnt-1")
    assert "ended 2023-11-14T22:13:20.000Z by platform" in result.out


async def test_end_rental_rejects_an_unknown_ender_before_any_call(coordinator, spotctl):
    result = await spotctl("rentals", "end", "rnt-1", "--ended-by", "reclaim")
    assert result.code == 2 and coordinator.calls == []


async def test_watch_rental_prints_every_update_until_it_ends(coordinator, spotctl):
    """A renter's tooling follows its rental: started, then a notice sets reclaim_at, then the
    container is stopped. One JSON object a line, in order."""
    updates = [
        rental(state="starting", started_at=0),
        rental(),
        rental(reclaim_at=T0 + 120, reclaim_id="rcl-4", reclaim_reason="notice"),
        rental(
            state="ended",
            reclaim_at=T0 + 120,
            reclaim_id="rcl-4",
            reclaim_reason="notice",
            ended_at=T0 + 120,
            ended_by="reclaim",
            exit_code=0,
        ),
    ]
    coordinator.replies["WatchRental"] = updates
    result = await spotctl("rentals", "watch", "rnt-1", "--json")
    assert result.code == 0
    assert only_call(coordinator) == ("WatchRental", pb.GetRentalRequest(rental_id="rnt-1"))
    assert result.json_lines() == [ctl.message_doc(u) for u in updates]
    assert [d["state"] for d in result.json_lines()] == ["starting", "running", "running", "ended"]
    text = await spotctl("rentals", "watch", "rnt-1")
    firsts = [line for line in text.out.splitlines() if line.startswith("rental ")]
    assert [line.rsplit(" ", 1)[1] for line in firsts] == [u.state for u in updates]
    assert text.out.count("RECLAIM at 2023-11-14T22:15:20.000Z") == 2


# --- reputation --------------------------------------------------------------------------------


async def test_reputation_of_a_node_shows_the_score_and_how_it_is_made(coordinator, spotctl):
    coordinator.replies["GetReputation"] = pb.Reputation(
        node_id="node-a",
        provider="acme",
        score=6 / 8,
        successes=2,
        failures=1,
        counted=3,
        excluded_spot=4,
        neutral_reclaims=1,
    )
    result = await spotctl("reputation", "node-a")
    assert only_call(coordinator) == ("GetReputation", pb.GetReputationRequest(node_id="node-a"))
    assert result.out.splitlines() == [
        "node node-a (provider acme): score 0.750",
        "  successes 2  failures 1  (counted 3)",
        "  left out: excluded spot rentals 4  neutral reclaims 1",
        f"  {FORMULA} = (2 + 4) / (2 + 1 + 5)",
    ]


async def test_reputation_of_a_provider(coordinator, spotctl):
    coordinator.replies["GetReputation"] = pb.Reputation(provider="acme", score=4 / 5)
    result = await spotctl("reputation", "--provider", "acme", "--json")
    call = only_call(coordinator)[1]
    assert call.WhichOneof("subject") == "provider" and call.provider == "acme"
    (doc,) = result.json_lines()
    assert doc["provider"] == "acme" and doc["score"] == 0.8 and doc["excluded_spot"] == 0
    text = await spotctl("reputation", "--provider", "acme")
    assert text.out.splitlines()[0] == "provider acme: score 0.800"


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "one of the arguments node --provider is required"),
        (["node-a", "--provider", "acme"], "not allowed with argument node"),
    ],
)
async def test_reputation_takes_exactly_one_subject(coordinator, spotctl, argv, message):
    result = await spotctl("reputation", *argv)
    assert result.code == 2 and message in result.err and coordinator.calls == []


# --- models and worker kinds -------------------------------------------------------------------


async def test_models_list_shows_desired_and_actual_workers(coordinator, spotctl):
    coordinator.replies["ListModels"] = pb.ListModelsReply(
        models=[
            pb.Model(model="llama-8b", replicas=3, image="llm:1", slots=4, ready=2, starting=1),
            pb.Model(model="sdxl", replicas=1, image="sd:2", slots=1, draining=1),
        ]
    )
    result = await spotctl("models", "list")
    assert only_call(coordinator) == ("ListModels", pb.ListModelsRequest())
    assert [line.split() for line in result.out.splitlines()] == [
        ["model", "replicas", "ready", "starting", "draining", "slots", "image"],
        ["llama-8b", "3", "2", "1", "0", "4", "llm:1"],
        ["sdxl", "1", "0", "0", "1", "1", "sd:2"],
    ]
    as_json = await spotctl("models", "list", "--json")
    assert [d["model"] for d in as_json.json_lines()] == ["llama-8b", "sdxl"]
    assert as_json.json_lines()[1]["ready"] == 0


async def test_set_replicas_sends_the_desired_capacity(coordinator, spotctl):
    coordinator.replies["SetModelReplicas"] = pb.Model(
        model="llama-8b", replicas=5, image="llm:1", slots=2
    )
    result = await spotctl(
        "models", "set-replicas", "llama-8b", "5", "--image", "llm:1", "--slots", "2", "--json"
    )
    assert only_call(coordinator) == (
        "SetModelReplicas",
        pb.SetModelReplicasRequest(model="llama-8b", replicas=5, image="llm:1", slots=2),
    )
    (doc,) = result.json_lines()
    assert doc["replicas"] == 5 and doc["starting"] == 0


@pytest.mark.parametrize("argv", [["m", "-1"], ["m", "two"], ["m", "1", "--slots", "-2"]])
async def test_set_replicas_needs_whole_numbers(coordinator, spotctl, argv):
    result = await spotctl("models", "set-replicas", *argv)
    assert result.code == 2 and "expected a whole number >= 0" in result.err
    assert coordinator.calls == []


@pytest.mark.parametrize(
    "flags, kind",
    [([], "inference"), (["--kind", "batch"], "batch"), (["--kind", "render"], "render")],
)
async def test_workers_start_sends_the_kind(coordinator, spotctl, flags, kind):
    coordinator.replies["StartWorker"] = pb.WorkerInfo(
        worker_id="w-1", node_id="node-a", model="m", kind=kind, state="starting"
    )
    result = await spotctl(
        "workers", "start", "node-a", "--model", "m", "--image", "img", *flags, "--json"
    )
    assert only_call(coordinator)[1] == pb.StartWorkerRequest(
        node_id="node-a", model="m", image="img", slots=4, kind=kind
    )
    assert json.loads(result.out)["kind"] == kind


async def test_workers_start_rejects_an_unknown_kind(coordinator, spotctl):
    result = await spotctl("workers", "start", "n", "--model", "m", "--image", "i", "--kind", "x")
    assert result.code == 2 and "invalid choice" in result.err and coordinator.calls == []
