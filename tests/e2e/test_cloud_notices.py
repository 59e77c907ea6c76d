"""Real agents hearing a cloud themselves: AWS's metadata service, Google's metadata server and
Azure's Scheduled Events emulated on loopback (tests/fakes/cloudmeta.py), a real coordinator, real
containers. Something that is not Google's metadata server is not believed. An advisory prepares
without draining; a notice that follows drains with the replacement already serving; a broken source
is reported and a malformed notice taints nothing; a Terminate the platform removes early lifts the
taint when nothing was stopped under it, and only then."""

from __future__ import annotations

import time

import pytest
from test_capacity_live import RouteWatcher, two_ready_workers
from test_pause import spotctl, wait_state

from fakes.cloudmeta import AwsImds, AzureMetadata, GceMetadata, azure_event, iso_utc
from fakes.dockerenv import run_workload
from fakes.harness import AgentOptions, start_agent
from fakes.waiting import wait_until
from images.fake_model import ensure_model_image
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

pytestmark = pytest.mark.docker


def aws_options(tmp_path, node: str, imds: AwsImds, ttl_s: float = 1800) -> AgentOptions:
    toml = tmp_path / f"{node}.toml"
    toml.write_text(
        f'[sources.aws]\nendpoint = "{imds.url}"\npoll_s = 0.2\n'
        f'[advisory]\naction = "prepare"\nttl_s = {ttl_s}\n'
    )
    return AgentOptions(
        grace_s=4.0,
        overrun_s=1.0,
        default_notice_s=20.0,
        extra=["--config", str(toml), "--sources", "file,aws"],
    )


def worker_states(admin) -> dict[str, tuple[str, str]]:
    return {
        w.worker_id: (w.node_id, w.state)
        for w in admin.ListWorkers(pb.ListWorkersRequest(), timeout=10).workers
    }


def test_a_rebalance_recommendation_prepares_and_the_notice_after_it_drains(
    tmp_path, docker_engine, coordinator, pki, gpus, nvml_lib
):
    """fake-model wants 2 replicas, on node-a (AWS) and node-b; node-c is free. node-a's IMDS
    shows a rebalance recommendation: the replacement starts on node-c while node-a keeps
    serving, never drained. 5 s later the instance action comes: node-a drains, and the
    router's view never has fewer than two ready workers."""
    image = ensure_model_image(docker_engine.client)
    imds = AwsImds()
    agents = {
        "node-a": start_agent(
            tmp_path,
            "node-a",
            coordinator,
            docker_engine.host,
            gpus,
            nvml_lib,
            aws_options(tmp_path, "node-a", imds),
        )
    }
    for n in ("node-b", "node-c"):
        agents[n] = start_agent(
            tmp_path,
            n,
            coordinator,
            docker_engine.host,
            gpus,
            nvml_lib,
            AgentOptions(grace_s=4.0, overrun_s=1.0),
        )
    admin = pb_grpc.AdminStub(coordinator.channel())
    events = coordinator.admin()
    watcher = None
    try:
        wait_until(lambda: sum(n.connected for n in events.nodes()) == 3, 20, "three nodes")
        first, second = two_ready_workers(coordinator, admin, image)
        watcher = RouteWatcher(coordinator, pki)
        wait_until(lambda: watcher.armed, 10, "the router to see two workers")

        imds.set_rebalance(iso_utc())
        advised = events.wait_for("advisory_received", node="node-a", timeout=10)
        assert (advised["source"], advised["reason"], advised["action"]) == (
            "aws",
            "rebalance",
            "prepare",
        )
        replacement = events.wait_for("worker_starting", node="node-c", timeout=20)
        assert replacement["wall_time"] >= advised["wall_time"]
        wait_state(coordinator, replacement["worker_id"], "ready", timeout=90)
        assert worker_states(admin)[first["worker_id"]] == ("node-a", "ready")
        assert spotctl(agents["node-a"], "status")["state"] == "available"
        assert not [
            e
            for e in events.events("node-a")
            if e["kind"] in ("worker_draining", "tainted", "sigterm_sent")
        ]

        time.sleep(5)  # the scenario's own pause between the warning and the notice
        deadline = int(time.time()) + 20  # AWS gives whole seconds
        imds.set_instance_action("terminate", iso_utc(deadline))
        notice = events.wait_for("notice_received", node="node-a", timeout=10)
        assert notice["source"] == "aws-instance-action"
        assert notice["terminate_at"] == deadline  # D is the provider's time, not T0 + default
        events.wait_for("verified_empty", node="node-a", timeout=30)
        states = worker_states(admin)
        assert states[replacement["worker_id"]] == ("node-c", "ready")
        assert states[second["worker_id"]] == ("node-b", "ready")
        assert watcher.fewest is not None and watcher.fewest >= 2
    finally:
        imds.close()
        for agent in agents.values():
            agent.proc.stop()


def test_an_advisory_alone_is_lifted_at_its_ttl_and_the_node_takes_work_again(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib
):
    imds = AwsImds()
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        aws_options(tmp_path, "node-a", imds, ttl_s=3),
    )
    admin = pb_grpc.AdminStub(coordinator.channel())
    events = coordinator.admin()
    try:
        wait_until(lambda: any(n.connected for n in events.nodes()), 20, "node-a")
        imds.set_rebalance(iso_utc())
        events.wait_for("advisory_received", node="node-a", timeout=10)
        with pytest.raises(Exception, match="at_risk"):
            admin.StartWorker(
                pb.StartWorkerRequest(node_id="node-a", model="m", image="img", slots=1), timeout=10
            )
        assert spotctl(agent, "status")["at_risk"][0]["reason"] == "rebalance"
        lifted = events.wait_for("advisory_lifted", node="node-a", timeout=15)
        assert lifted["why"] == "ttl"
        wait_until(lambda: _admitted(admin), 10, "node-a to take work again")
        # IMDS still shows the recommendation; it is not raised a second time.
        polls = len(imds.seen)
        wait_until(lambda: len(imds.seen) > polls + 9, 10, "more polls")
        assert len([e for e in events.events("node-a") if e["kind"] == "advisory_received"]) == 1
    finally:
        imds.close()
        agent.proc.stop()


def _admitted(admin) -> bool:
    try:
        admin.StartWorker(
            pb.StartWorkerRequest(node_id="node-a", model="m", image="img", slots=1), timeout=10
        )
        return True
    except Exception as e:  # noqa: BLE001 - the refusal until the node is open again
        assert "at_risk" in str(e)
        return False


def test_a_broken_source_is_reported_and_a_malformed_notice_taints_nothing(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib
):
    """node-a's IMDS answers its instance id 503 three times (about 8 s of retries): node-a
    registers without its cloud identity, then, once the id is read, registers again on the same
    stream and ListNodes shows the instance. Its IMDS then stops answering: the source is down,
    then up again. A malformed instance action taints nothing."""
    imds = AwsImds(instance_id="i-0e2e0000000000001", zone="us-east-1c", instance_type="g6.xlarge")
    imds.fail_next(3, 503, path="/latest/meta-data/instance-id")
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        aws_options(tmp_path, "node-a", imds),
    )
    events = coordinator.admin()
    try:
        wait_until(
            lambda: [(n.connected, n.HasField("cloud")) for n in events.nodes()] == [(True, False)],
            20,
            "node-a registered without its cloud identity",
        )
        node = wait_until(
            lambda: next((n for n in events.nodes() if n.HasField("cloud")), None),
            20,
            "node-a registered with its cloud identity",
        )
        assert node.connected and node.cloud == pb.CloudIdentity(
            provider="aws",
            instance_id="i-0e2e0000000000001",
            region="us-east-1",
            zone="us-east-1c",
            instance_type="g6.xlarge",
            spot=True,
        )
        assert agent.proc.log().count("registered with coordinator") == 1  # one stream
        status = spotctl(agent, "status")
        assert [(s["source"], s["up"]) for s in status["sources"]] == [
            ("file", True),
            ("aws", True),
        ]
        imds.refuse()
        down = events.wait_for("notice_source_down", node="node-a", timeout=15)
        assert down["source"] == "aws" and "instance-action" in down["error"]
        assert [s["up"] for s in spotctl(agent, "status")["sources"]] == [True, False]
        imds.accept()
        up = events.wait_for("notice_source_up", node="node-a", timeout=15)
        assert up["source"] == "aws"

        imds.set_instance_action("terminate", iso_utc(time.time() + 60))
        imds.malformed_next(1000, path="/latest/meta-data/spot/instance-action")
        invalid = events.wait_for("notice_invalid", node="node-a", timeout=10)
        assert "sha256:" in invalid["content_hash"]
        assert spotctl(agent, "status")["state"] == "available"
        assert not [
            e for e in events.events("node-a") if e["kind"] in ("notice_received", "tainted")
        ]
    finally:
        imds.close()
        agent.proc.stop()


def azure_options(tmp_path, node: str, server: AzureMetadata) -> AgentOptions:
    toml = tmp_path / f"{node}.toml"
    toml.write_text(f'[sources.azure]\nendpoint = "{server.url}"\npoll_s = 0.2\n')
    return AgentOptions(
        grace_s=4.0,
        overrun_s=1.0,
        default_notice_s=20.0,
        extra=["--config", str(toml), "--sources", "file,azure"],
    )


def azure_agent(tmp_path, coordinator, docker_engine, gpus, nvml_lib):
    """node-a's agent reading Scheduled Events from its own emulated Azure, connected."""
    server = AzureMetadata(vm_name="node-a")
    options = azure_options(tmp_path, "node-a", server)
    agent = start_agent(
        tmp_path, "node-a", coordinator, docker_engine.host, gpus, nvml_lib, options
    )
    events = coordinator.admin()
    try:
        wait_until(lambda: any(n.connected for n in events.nodes()), 20, "node-a")
    except BaseException:
        server.close()
        agent.proc.stop()
        raise
    return server, agent, events


def schedule_terminate(server: AzureMetadata, event_id: str, not_before: float, **kw) -> None:
    event = azure_event(
        event_id, event_type="Terminate", resources=["node-a"], not_before=not_before, **kw
    )
    server.set_events([event])


def taints(events, node: str) -> list:
    return [t for n in events.nodes() if n.node_id == node for t in n.taints]


def test_a_terminate_removed_early_from_an_empty_node_lifts_its_taint(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib
):
    """Nothing runs on node-a when Azure schedules a Terminate two minutes out (NotBefore as
    Microsoft's mock server writes it). The node is tainted and verified empty at once. 84 s
    before NotBefore the platform removes the event: the provider called it off. Nothing was
    stopped under it, so the taint is lifted, the timeline says lifted, and the node is
    available again."""
    server, agent, events = azure_agent(tmp_path, coordinator, docker_engine, gpus, nvml_lib)
    try:
        not_before = int(time.time()) + 120
        schedule_terminate(server, "T-1", not_before, date_style="iso")
        notice = events.wait_for("notice_received", node="node-a", timeout=15)
        assert (notice["source"], notice["terminate_at"]) == ("azure", not_before)
        events.wait_for("drained", node="node-a", timeout=15)
        assert taints(events, "node-a")
        server.set_events([])
        cancelled = events.wait_for("notice_cancelled", node="node-a", timeout=15)
        assert cancelled["lifted"] is True and cancelled["outcome"] == "drained"
        assert cancelled["reclaim_id"] == notice["reclaim_id"]
        wait_until(lambda: not taints(events, "node-a"), 10, "the taint lifted")
        wait_until(lambda: spotctl(agent, "status")["state"] == "available", 10, "available")
        assert "sigterm_sent" not in events.kinds(node="node-a")
    finally:
        server.close()
        agent.proc.stop()


def test_a_terminate_removed_after_a_job_was_stopped_keeps_the_taint(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib, containers
):
    """A job runs on node-a when the Terminate comes: it gets its SIGTERM and leaves, and the
    node is drained. Then the platform removes the event early. Something was stopped under
    the notice, so the cancel is recorded and the taint stays."""
    run_workload(
        docker_engine.client, name=containers + "job", node_id="node-a", kind="exits_on_term"
    )
    server, agent, events = azure_agent(tmp_path, coordinator, docker_engine, gpus, nvml_lib)
    try:
        schedule_terminate(server, "T-2", time.time() + 120)
        events.wait_for("sigterm_sent", node="node-a", timeout=15)
        events.wait_for("drained", node="node-a", timeout=15)
        server.set_events([])
        cancelled = events.wait_for("notice_cancelled", node="node-a", timeout=15)
        assert cancelled["lifted"] is False and cancelled["outcome"] == "drained"
        # Barrier: a later notice's record, stored after the cancel, with the taint still on.
        agent.write_notice({"id": "later", "action": "terminate", "terminate_at": time.time() + 60})
        events.wait_for("notice_received", node="node-a", notice_id="later", timeout=15)
        assert cancelled["reclaim_id"] in {t.reclaim_id for t in taints(events, "node-a")}
    finally:
        server.close()
        agent.proc.stop()


def test_a_preemption_from_something_that_is_not_the_metadata_server_opens_nothing(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib
):
    """Something else answers on the metadata address (a proxy, a captive portal) and says the
    VM is preempted, without `Metadata-Flavor: Google`. No reclamation opens and the source is
    reported down, naming why; once the real server answers, the source is up and its own
    TRUE is the notice."""
    server = GceMetadata()
    server.set_preempted(True)
    server.impostor()
    toml = tmp_path / "node-a.toml"
    toml.write_text(f'[sources.gcp]\nendpoint = "{server.url}"\n')
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(
            grace_s=4.0,
            overrun_s=1.0,
            default_notice_s=20.0,
            extra=["--config", str(toml), "--sources", "file,gcp"],
        ),
    )
    events = coordinator.admin()
    try:
        down = events.wait_for("notice_source_down", node="node-a", timeout=20)
        assert down["source"] == "gcp" and "without Metadata-Flavor: Google" in down["error"]
        # The source read TRUE three times before it was down: none of it became a notice.
        assert not {"notice_received", "tainted"} & set(events.kinds(node="node-a"))
        assert spotctl(agent, "status")["state"] == "available"
        server.impostor(False)
        events.wait_for("notice_source_up", node="node-a", timeout=15)
        notice = events.wait_for("notice_received", node="node-a", timeout=15)
        assert notice["source"] == "gcp"
    finally:
        server.close()
        agent.proc.stop()
