"""Each cloud's notice source reads the node's cloud identity from the suite's own emulator of its
metadata service (tests/fakes/cloudmeta.py), over real HTTP on loopback: what it reports, that a
slow identity read never holds a notice back, and that a value the coordinator would refuse, or an
answer that is not the metadata server's, is never reported."""

from __future__ import annotations

import pytest
from test_sources import NOW, Recorder, aws_source, has, iso_utc, running

from fakes.cloudmeta import AwsImds, AzureMetadata, GceMetadata
from spotdrain.agent.core.notice import Notice
from spotdrain.agent.notices import azure, gcp
from spotdrain.agent.notices.identity import CloudIdentity

AWS_ID = "/latest/meta-data/instance-id"
AWS_TYPE = "/latest/meta-data/instance-type"


async def identified(sink: Recorder, timeout: float = 10.0) -> CloudIdentity:
    await sink.until(lambda _: sink.identities, timeout)
    return sink.identities[0][1]


@pytest.mark.parametrize("life_cycle, spot", [("spot", True), ("on-demand", False)])
async def test_aws_source_reports_the_instance_it_runs_on(life_cycle, spot):
    """IMDS describes a g5.xlarge in us-east-1a: the source reports it once, every read with
    the session token, and goes on polling without reading it again."""
    with AwsImds(instance_id="i-0abc", life_cycle=life_cycle) as imds:
        sink = Recorder()
        async with running(aws_source(imds, sink)):
            found = await identified(sink)
            reads = len([s for s in imds.seen if s.path == AWS_ID])
            polls = len(imds.seen)
            await imds.await_seen(count=polls + 9)  # three more poll rounds
        assert found == CloudIdentity("aws", "i-0abc", "us-east-1", "us-east-1a", "g5.xlarge", spot)
        assert len(sink.identities) == 1 and reads == 1
        assert len([s for s in imds.seen if s.path == AWS_ID]) == 1
        identity_reads = [
            s
            for s in imds.seen
            if s.path.startswith("/latest/meta-data/")
            and ("placement" in s.path or s.path in (AWS_ID, AWS_TYPE))
        ]
        assert all(s.headers.get("X-aws-ec2-metadata-token") for s in identity_reads)


async def test_aws_identity_read_past_its_deadline_holds_no_notice_back():
    """The first two identity reads are trickled a byte every 0.3 s, past the 0.5 s a read may
    take. The instance action set meanwhile is a notice at once; the identity comes on a later
    retry, and the source was never down."""
    with AwsImds() as imds:
        imds.trickle_next(2, path=AWS_ID, every_s=0.3)
        sink = Recorder()
        async with running(aws_source(imds, sink)):
            await imds.await_seen(lambda s: s.path == AWS_ID)
            imds.set_instance_action("terminate", iso_utc(NOW + 120))
            await sink.until(has(Notice))
            found = await identified(sink, timeout=15)
        assert found.instance_id == "i-0123456789abcdef0"
        ((told_before, _),) = sink.identities
        assert told_before >= 1 and isinstance(sink.told[0], Notice)  # the notice came first
        assert len([s for s in imds.seen if s.path == AWS_ID]) == 3
        assert ("down", "aws") not in sink.told


async def test_aws_identity_the_coordinator_would_refuse_is_never_reported():
    """IMDS answers an instance type of 65 characters: the identity is not reported (the
    coordinator would refuse the whole registration), however often it is read again; the
    source's notices go on meanwhile."""
    with AwsImds(instance_type="g" * 65) as imds:
        sink = Recorder()
        async with running(aws_source(imds, sink)):
            await imds.await_seen(lambda s: s.path == AWS_TYPE and s.status == 200, count=2)
            imds.set_instance_action("terminate", iso_utc(NOW + 120))
            await sink.until(has(Notice))
        assert sink.identities == []


def gcp_source(server: GceMetadata, sink: Recorder) -> gcp.Source:
    cfg = gcp.Config.from_table({"endpoint": server.url, "hang_s": 30}, "")
    return gcp.Source(cfg, sink, clock=lambda: NOW)


@pytest.mark.parametrize(
    "preemptible, model, spot",
    [(True, "SPOT", True), (False, "SPOT", True), (True, None, True), (False, None, False)],
    ids=["spot", "spot-model-only", "preemptible-no-model", "standard"],
)
async def test_gcp_source_reports_the_instance_it_runs_on(preemptible, model, spot):
    """The metadata server names the zone and machine type as resource paths: the source reports
    their last parts, the region from the zone, and spot from `preemptible` or the provisioning
    model (a server without that key answers 404: not a failure). Every read says
    Metadata-Flavor: Google."""
    with GceMetadata(
        instance_id="4520031799277581759",
        zone="europe-west4-b",
        machine_type="a2-highgpu-1g",
        preemptible=preemptible,
        provisioning_model=model,
    ) as server:
        sink = Recorder()
        async with running(gcp_source(server, sink)):
            found = await identified(sink)
        assert found == CloudIdentity(
            "gcp", "4520031799277581759", "europe-west4", "europe-west4-b", "a2-highgpu-1g", spot
        )
        assert all(s.headers.get("Metadata-Flavor") == "Google" for s in server.seen)


async def test_gcp_identity_from_something_that_is_not_the_metadata_server_is_not_believed():
    """Something else answers on the metadata address: no identity is reported from it, read
    twice; once the real server answers, its identity is."""
    with GceMetadata() as server:
        server.impostor()
        sink = Recorder()
        async with running(gcp_source(server, sink)):
            await server.await_seen(
                lambda s: s.path.endswith("/instance/id") and s.status == 200, count=2
            )
            assert sink.identities == []
            server.impostor(False)
            found = await identified(sink, timeout=15)
        assert (found.provider, found.zone, found.spot) == ("gcp", "us-central1-a", True)


def azure_source(server: AzureMetadata, sink: Recorder) -> azure.Source:
    # The VM's name given: the poll reads no compute/name, so every compute read is the identity's.
    table = {"endpoint": server.url, "poll_s": 0.1, "vm_name": server.vm_name}
    cfg = azure.Config.from_table(table, "")
    return azure.Source(cfg, sink, clock=lambda: NOW)


@pytest.mark.parametrize("priority, spot", [("Spot", True), ("Regular", False)])
async def test_azure_source_reports_the_vm_from_its_compute_document(priority, spot):
    """The compute document (Metadata: true, an api-version) gives the VM's id, location, zone,
    size and priority."""
    with AzureMetadata(
        vm_id="0f5a9c3e-6d1b-4c1e-9f7a-2b8e4d6c1a90",
        location="swedencentral",
        zone="2",
        vm_size="Standard_ND96asr_v4",
        priority=priority,
    ) as server:
        sink = Recorder()
        async with running(azure_source(server, sink)):
            found = await identified(sink)
        assert found == CloudIdentity(
            "azure",
            "0f5a9c3e-6d1b-4c1e-9f7a-2b8e4d6c1a90",
            "swedencentral",
            "2",
            "Standard_ND96asr_v4",
            spot,
        )
        (read,) = [s for s in server.seen if s.path == "/metadata/instance/compute"]
        assert read.headers.get("Metadata") == "true" and read.query.get("api-version")


async def test_azure_identity_retried_after_a_failed_read():
    """IMDS answers the compute document 500 twice: the third read is reported."""
    with AzureMetadata() as server:
        server.fail_next(2, 500, path="/metadata/instance/compute")
        sink = Recorder()
        async with running(azure_source(server, sink)):
            found = await identified(sink, timeout=15)
        assert (found.region, found.zone, found.spot) == ("westeurope", "1", True)
        computes = [s for s in server.seen if s.path == "/metadata/instance/compute"]
        assert [s.status for s in computes] == [500, 500, 200]
