"""Each cloud's notice source against the test suite's own emulator of its metadata service
(tests/fakes/cloudmeta.py), failure modes included. The sink is a recorder: what the source told the
agent, in order. Deadlines are checked against an injected clock."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from typing import Any

import pytest

from fakes.cloudmeta import (
    AZURE_DATE_STYLES,
    AwsImds,
    AzureMetadata,
    GceMetadata,
    ManualClock,
    aws_maintenance_event,
    iso_utc,
    unreadable_event,
)
from spotdrain.agent.core.notice import Notice, NoticeInvalid
from spotdrain.agent.notices import aws, azure, gcp
from spotdrain.agent.notices.base import Advisory, Health, slept_s

NOW = 1_800_000_000.0  # the injected clock: deadlines computed from it are exact


class Recorder:
    """A Sink that keeps what it is told; `settle(key, outcome)` ends a `settled` wait."""

    def __init__(self) -> None:
        self.told: list[Any] = []
        # Each cloud identity with how many things were told before it (apart from `told`, which
        # the notice tests compare whole).
        self.identities: list[tuple[int, Any]] = []
        self.changed = asyncio.Event()
        self._settle: dict[str, asyncio.Future[str]] = {}

    def _add(self, item: Any) -> None:
        self.told.append(item)
        self.changed.set()

    def notice(self, parsed: Notice | NoticeInvalid) -> None:
        self._add(parsed)

    def advisory(self, advisory: Advisory) -> None:
        self._add(advisory)

    def record(self, source: str, kind: str, details: dict[str, Any]) -> None:
        self._add((kind, details))

    def health_changed(self, health: Health) -> None:
        self._add(("up" if health.up else "down", health.source))

    def identity(self, identity: Any) -> None:
        self.identities.append((len(self.told), identity))
        self.changed.set()

    async def settled(self, key: str) -> str:
        fut = self._settle.setdefault(key, asyncio.get_running_loop().create_future())
        return await fut

    def settle(self, key: str, outcome: str) -> None:
        self._settle.setdefault(key, asyncio.get_running_loop().create_future())
        self._settle[key].set_result(outcome)

    async def until(self, predicate, timeout: float = 10.0) -> list[Any]:
        async with asyncio.timeout(timeout):
            while not predicate(self.told):
                self.changed.clear()
                await self.changed.wait()
        return self.told

    def of(self, kind: type) -> list[Any]:
        return [t for t in self.told if isinstance(t, kind)]


@contextlib.asynccontextmanager
async def running(source):
    """The source's task for the block; a source that crashed meanwhile fails the test here."""
    task = asyncio.create_task(source.run())
    try:
        yield source
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def has(kind: type, n: int = 1, **fields):
    def check(told: list[Any]) -> bool:
        found = [
            t
            for t in told
            if isinstance(t, kind) and all(getattr(t, k) == v for k, v in fields.items())
        ]
        return len(found) >= n

    return check


# --- AWS ---------------------------------------------------------------------------------------


BOOT = "0c9f0d5e-6f43-4a3e-9d0c-2b4c8a1e7f10"
INSTANCE_ACTION = "/latest/meta-data/spot/instance-action"


def aws_source(imds: AwsImds, sink: Recorder, slept=lambda: 0.0) -> aws.Source:
    """`slept`: the seconds this boot has spent suspended (a host that never slept, unless told)."""
    cfg = aws.Config.from_table({"endpoint": imds.url, "poll_s": 0.1}, "")
    return aws.Source(cfg, sink, clock=lambda: NOW, boot=lambda: BOOT, slept=slept)


def instance_action_reads(imds: AwsImds) -> int:
    return len([s for s in imds.seen if s.path == INSTANCE_ACTION and s.status is not None])


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_aws_instance_action_split_in_two_is_read_whole_and_acted_on(chunked):
    """A link splits every answer in two, 150 ms apart (inside the read's deadline): the
    notice is read from the whole document, never from its first half."""
    with AwsImds() as imds:
        imds.set_instance_action("terminate", iso_utc(NOW + 120))
        imds.split_next(1000, path=INSTANCE_ACTION, gap_s=0.15, chunked=chunked)
        sink = Recorder()
        async with running(aws_source(imds, sink)):
            await sink.until(has(Notice))
            await imds.await_seen(
                lambda s: s.path == INSTANCE_ACTION and s.status == 200,
                count=instance_action_reads(imds) + 3,
            )
        assert [(n.key, n.terminate_at) for n in sink.of(Notice)] == [
            (f"aws:instance-action:{BOOT}", NOW + 120)
        ]
        assert not sink.of(NoticeInvalid) and ("down", "aws") not in sink.told


async def test_aws_instance_action_trickled_past_the_deadline_is_a_failed_read():
    """A byte every 250 ms: no read ends inside its 0.5 s deadline, so each is a failure and
    the source reports itself down; no part of the document is ever taken for one."""
    with AwsImds() as imds:
        imds.set_instance_action("terminate", iso_utc(NOW + 120))
        imds.trickle_next(1000, path=INSTANCE_ACTION, every_s=0.25)
        sink = Recorder()
        async with running(aws_source(imds, sink)) as source:
            await sink.until(lambda told: ("down", "aws") in told)
            assert "no whole answer" in source.health.error
        assert sink.told == [("down", "aws")]


async def test_aws_instance_action_re_stamped_on_every_read_is_one_interruption():
    """AWS's own mock writes `time` afresh on every read: every poll is a new document, all of
    them this boot's one interruption (one key), never a new notice each."""
    wall = itertools.count(NOW, 1.0)
    with AwsImds(wall=lambda: next(wall)) as imds:
        imds.set_instance_action("terminate", restamp_in_s=120)
        sink = Recorder()
        async with running(aws_source(imds, sink)):
            await sink.until(has(Notice, 5))
        notices = sink.of(Notice)
        assert {n.key for n in notices} == {f"aws:instance-action:{BOOT}"}
        times = [n.terminate_at for n in notices]
        assert times == sorted(times) and len(set(times)) == len(times)  # re-stamped each read


async def test_aws_rebalance_re_stamped_on_every_read_is_one_advisory():
    """One rebalance recommendation per boot, whatever noticeTime each read names."""
    wall = itertools.count(NOW, 1.0)
    with AwsImds(wall=lambda: next(wall)) as imds:
        imds.set_rebalance(restamp=True)
        sink = Recorder()
        async with running(aws_source(imds, sink)):
            await sink.until(has(Advisory))
            await imds.await_seen(lambda s: s.path.endswith("rebalance"), count=6)
        assert [(a.key, a.withdrawn) for a in sink.of(Advisory)] == [
            (f"aws:rebalance:{BOOT}", False)
        ]


async def test_aws_rebalance_survives_two_missing_reads_and_comes_anew_after_a_resume():
    """A rebalance recommendation missing from two reads in a row is not withdrawn (withdrawn,
    the agent would never raise it again); after the instance hibernated and resumed, the old
    one is withdrawn and a new recommendation is a new advisory, not the lifted one again."""
    slept = ManualClock(0.0)
    with AwsImds() as imds:
        imds.set_rebalance(iso_utc(NOW))
        sink = Recorder()
        async with running(aws_source(imds, sink, slept)):
            await sink.until(has(Advisory))
            path = "/latest/meta-data/events/recommendations/rebalance"
            imds.fail_next(2, 404, path=path)
            await imds.await_seen(lambda s: s.path == path and s.status == 404, count=2)
            back = len([s for s in imds.seen if s.path == path and s.status == 200])
            # A barrier: a read answered after the two 404s, and a later one, so it was handled.
            await imds.await_seen(lambda s: s.path == path and s.status == 200, count=back + 2)
            assert [a.withdrawn for a in sink.of(Advisory)] == [False]
            imds.resume()
            slept.advance(3600.0)
            await sink.until(has(Advisory, withdrawn=True))
            imds.set_rebalance(iso_utc(NOW + 3600))
            await sink.until(has(Advisory, 2, withdrawn=False))
        first, withdrawn, second = sink.of(Advisory)
        assert first.key == withdrawn.key == f"aws:rebalance:{BOOT}" and withdrawn.withdrawn
        assert second.key == f"aws:rebalance:{BOOT}:3600s:0" and not second.withdrawn


async def test_aws_instance_action_keys_name_each_interruption_of_one_boot():
    """One boot, three interruptions: the first keyed by the boot alone (as in every earlier
    version, so a restart mid-drain finds its bundle), one after the notice went away, and one
    after a hibernation, whose key holds even for an agent that started after the resume."""
    slept = ManualClock(0.0)
    with AwsImds() as imds:
        sink = Recorder()
        imds.set_instance_action("terminate", iso_utc(NOW + 120))
        async with running(aws_source(imds, sink, slept)):
            await sink.until(has(Notice))
            imds.clear_instance_action()
            await imds.await_seen(
                lambda s: s.path == INSTANCE_ACTION and s.status == 404, count=aws.GONE_AFTER
            )
            imds.set_instance_action("stop", iso_utc(NOW + 240))
            await sink.until(has(Notice, 2))
            imds.resume()
            slept.advance(7200.4)
            imds.set_instance_action("hibernate", iso_utc(NOW + 360))
            await sink.until(has(Notice, action="hibernate"))
        after_restart = Recorder()
        async with running(aws_source(imds, after_restart, slept)):
            await after_restart.until(has(Notice))
        assert [n.key for n in sink.of(Notice)] == [
            f"aws:instance-action:{BOOT}",
            f"aws:instance-action:{BOOT}:0s:1",
            f"aws:instance-action:{BOOT}:7200s:0",
        ]
        assert [n.key for n in after_restart.of(Notice)] == [f"aws:instance-action:{BOOT}:7200s:0"]


def test_the_time_slept_reads_the_same_while_the_host_stays_awake():
    """CLOCK_BOOTTIME - CLOCK_MONOTONIC moves only by a suspend: read twice, it agrees far
    inside the second the keys are rounded to."""
    first, second = slept_s(), slept_s()
    assert first >= 0.0 and abs(second - first) < 0.001


@pytest.mark.parametrize(
    "document",
    [
        {"action": "cancel", "id": "i-other"},
        {"action": "reboot", "time": "2027-01-15T08:00:00Z"},
    ],
    ids=["cancel", "unknown-action"],
)
def test_aws_instance_action_only_takes_the_actions_aws_writes(document):
    parsed = aws.parse_instance_action(json.dumps(document).encode(), BOOT)
    assert isinstance(parsed, NoticeInvalid)


async def test_aws_instance_action_is_a_notice_with_its_time_as_deadline():
    """A spot interruption: instance-action appears with terminate at T+120; the source tells
    one notice whose D is that time, and the same document read again tells nothing more."""
    with AwsImds() as imds:
        sink = Recorder()
        async with running(aws_source(imds, sink)):
            await imds.await_seen(lambda s: s.path.endswith("instance-action") and s.status == 404)
            imds.set_instance_action("terminate", iso_utc(NOW + 120))
            await sink.until(has(Notice))
            polls = len(imds.seen)
            await imds.await_seen(
                lambda s: s.path.endswith("instance-action"),
                count=len([s for s in imds.seen if s.path.endswith("instance-action")]) + 3,
            )
        assert len(imds.seen) > polls
        notices = sink.of(Notice)
        assert len(notices) == 1
        assert notices[0].action == "terminate" and notices[0].terminate_at == NOW + 120
        # Every read carried a token; the token was taken once.
        gets = [s for s in imds.seen if s.method == "GET"]
        assert gets and all(s.headers.get("X-aws-ec2-metadata-token") for s in gets)
        assert len([s for s in imds.seen if s.method == "PUT"]) == 1


async def test_aws_expired_token_is_renewed_at_the_first_401():
    with AwsImds() as imds:
        sink = Recorder()
        async with running(aws_source(imds, sink)):
            await imds.await_seen(lambda s: s.status == 404)
            imds.expire_tokens()
            imds.set_instance_action("stop", iso_utc(NOW + 120))
            await sink.until(has(Notice))
        statuses = [(s.method, s.status) for s in imds.seen]
        assert ("GET", 401) in statuses
        first_401 = statuses.index(("GET", 401))
        assert ("PUT", 200) in statuses[first_401:]  # renewed after the 401, then read again
        assert sink.of(Notice)[0].action == "stop"
        assert not [t for t in sink.told if t == ("down", "aws")]  # one 401 is not an outage


async def test_aws_token_put_that_fails_takes_the_source_down_then_up():
    with AwsImds() as imds:
        imds.fail_token_put(4, status=503)
        sink = Recorder()
        async with running(aws_source(imds, sink)) as source:
            await sink.until(lambda told: ("up", "aws") in told)
            assert source.health.up
        assert sink.told[:2] == [("down", "aws"), ("up", "aws")]


async def test_aws_malformed_instance_action_is_invalid_once_and_no_notice():
    with AwsImds() as imds:
        imds.set_instance_action("terminate", iso_utc(NOW + 120))
        imds.malformed_next(50, path="/latest/meta-data/spot/instance-action")
        sink = Recorder()
        async with running(aws_source(imds, sink)):
            await sink.until(has(NoticeInvalid))
            await imds.await_seen(lambda s: s.path.endswith("instance-action"), count=5)
        assert len(sink.of(NoticeInvalid)) == 1
        assert not sink.of(Notice)


async def test_aws_refused_endpoint_is_down_then_up_when_it_answers_again():
    with AwsImds() as imds:
        sink = Recorder()
        async with running(aws_source(imds, sink)) as source:
            await imds.await_seen(lambda s: s.status == 404)
            imds.refuse()
            await sink.until(lambda told: ("down", "aws") in told)
            assert not source.health.up and "instance-action" in source.health.error
            imds.accept()
            await sink.until(lambda told: ("up", "aws") in told)


async def test_aws_rebalance_and_maintenance_are_advisories_withdrawn_when_over():
    with AwsImds() as imds:
        sink = Recorder()
        event = aws_maintenance_event(
            "system-reboot", event_id="instance-event-0abc", not_before=NOW + 3600
        )
        imds.set_rebalance(iso_utc(NOW))
        imds.set_maintenance([event])
        async with running(aws_source(imds, sink)):
            await sink.until(has(Advisory, 2))
            imds.set_maintenance([{**event, "State": "canceled"}])
            await sink.until(has(Advisory, withdrawn=True))
        received = [a for a in sink.of(Advisory) if not a.withdrawn]
        assert sorted(a.reason for a in received) == ["maintenance", "rebalance"]
        maint = next(a for a in received if a.reason == "maintenance")
        assert maint.key == "aws:maintenance:instance-event-0abc"
        assert maint.not_before == pytest.approx(NOW + 3600, abs=1)
        withdrawn = [a for a in sink.of(Advisory) if a.withdrawn]
        assert [a.key for a in withdrawn] == [maint.key]  # the rebalance stays up
        assert not sink.of(Notice)


# --- Google Cloud ------------------------------------------------------------------------------


def gcp_source(server: GceMetadata, sink: Recorder) -> gcp.Source:
    cfg = gcp.Config.from_table({"endpoint": server.url, "hang_s": 30}, "")
    return gcp.Source(cfg, sink, clock=lambda: NOW)


async def test_gcp_preemption_is_a_notice_at_t0_plus_notice_s_from_a_hanging_get():
    with GceMetadata() as server:
        sink = Recorder()
        async with running(gcp_source(server, sink)) as source:
            await asyncio.to_thread(server.wait_hanging, 2)
            server.set_preempted(True)
            await sink.until(has(Notice))
        notice = sink.of(Notice)[0]
        assert notice.terminate_at == NOW + 30 and notice.source == "gcp"
        assert notice.key == f"gcp:preempted:{source.boot}"
        hanging = [s for s in server.seen if s.query.get("wait_for_change") == "true"]
        assert hanging and all(s.headers.get("Metadata-Flavor") == "Google" for s in hanging)


async def test_gcp_hang_ended_early_is_re_armed_and_tells_nothing():
    with GceMetadata() as server:
        sink = Recorder()
        async with running(gcp_source(server, sink)):
            await asyncio.to_thread(server.wait_hanging, 2)
            await sink.until(lambda _: sink.identities)  # its reads done: none among the re-arms
            before = len(server.seen)
            assert server.end_hanging_early() == 2
            await server.await_seen(count=before + 2)  # both re-armed, same last_etag
            await asyncio.to_thread(server.wait_hanging, 2)
            server.set_preempted(True)
            await sink.until(has(Notice))
        assert len(sink.of(Notice)) == 1 and not sink.of(Advisory)
        rearmed = server.seen[before : before + 2]
        assert {s.query.get("last_etag") for s in rearmed} == {
            server._etag("preempted", "FALSE"),
            server._etag("maintenance-event", "NONE"),
        }


async def test_gcp_migration_is_an_advisory_and_terminate_maintenance_a_notice():
    with GceMetadata() as server:
        sink = Recorder()
        async with running(gcp_source(server, sink)):
            await asyncio.to_thread(server.wait_hanging, 2)
            server.set_maintenance_event("MIGRATE_ON_HOST_MAINTENANCE")
            await sink.until(has(Advisory))
            server.set_maintenance_event("NONE")
            await sink.until(has(Advisory, withdrawn=True))
            server.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
            await sink.until(has(Notice))
        advisories = sink.of(Advisory)
        assert [(a.reason, a.withdrawn) for a in advisories] == [
            ("migrate", False),
            ("migrate", True),
        ]
        assert sink.of(Notice)[0].terminate_at == NOW + 60


async def test_gcp_unreachable_server_is_down_then_up_and_re_armed():
    with GceMetadata() as server:
        sink = Recorder()
        async with running(gcp_source(server, sink)):
            await asyncio.to_thread(server.wait_hanging, 2)
            server.refuse()
            await sink.until(lambda told: ("down", "gcp") in told)
            server.accept()
            await sink.until(lambda told: ("up", "gcp") in told)
            server.set_preempted(True)
            await sink.until(has(Notice))


async def test_gcp_answer_without_metadata_flavor_is_not_believed_and_the_source_is_down():
    """Something other than the metadata server answers on its address (a proxy, a captive
    portal) and says TRUE, without `Metadata-Flavor: Google`. Not the provider: no notice, and
    the source reports itself down, naming why. Once the real server answers again, it is up,
    and its own TRUE is the notice."""
    with GceMetadata() as server:
        server.set_preempted(True)
        server.impostor()
        sink = Recorder()
        async with running(gcp_source(server, sink)) as source:
            # Three failed reads before "down", each of them a TRUE: none became a notice.
            await sink.until(lambda told: ("down", "gcp") in told)
            assert sink.told == [("down", "gcp")]
            assert "without Metadata-Flavor: Google" in source.health.error
            server.impostor(False)
            await sink.until(has(Notice))
        assert sink.told[:2] == [("down", "gcp"), ("up", "gcp")]
        assert [n.action for n in sink.of(Notice)] == ["terminate"]


async def test_gcp_unexpected_value_is_invalid_not_a_notice():
    with GceMetadata() as server:
        server.malformed_next(1, path="/computeMetadata/v1/instance/preempted")
        sink = Recorder()
        async with running(gcp_source(server, sink)):
            await sink.until(has(NoticeInvalid))
        assert not sink.of(Notice)


# --- Azure -------------------------------------------------------------------------------------


def azure_event(
    event_id: str,
    kind: str = "Preempt",
    vm: str = "gpu-node-0",
    not_before: float | None = NOW + 30,
    style: str = "rfc1123",
) -> dict:
    return {
        "EventId": event_id,
        "EventType": kind,
        "ResourceType": "VirtualMachine",
        "Resources": [vm],
        "EventStatus": "Scheduled",
        "NotBefore": AZURE_DATE_STYLES[style](not_before) if not_before else "",
        "Description": "",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    }


def azure_source(server: AzureMetadata, sink: Recorder, **table) -> azure.Source:
    cfg = azure.Config.from_table({"endpoint": server.url, "poll_s": 0.1, **table}, "")
    return azure.Source(cfg, sink, clock=lambda: NOW)


async def test_azure_preempt_for_this_vm_is_a_notice_and_another_vms_is_ignored():
    with AzureMetadata(vm_name="gpu-node-0") as server:
        sink = Recorder()
        async with running(azure_source(server, sink)):
            server.set_events(
                [
                    azure_event("other-1", vm="gpu-node-9"),
                    azure_event("mine-1", not_before=NOW + 30),
                ]
            )
            await sink.until(has(Notice))
            server.bump_incarnation()  # a new document, nothing new for this VM
            await server.await_seen(lambda s: s.path == "/metadata/scheduledevents", count=20)
        notices = sink.of(Notice)
        assert [(n.key, n.terminate_at) for n in notices] == [("azure:mine-1", NOW + 30)]
        assert all(s.headers.get("Metadata") == "true" for s in server.seen)


async def test_azure_empty_not_before_is_t0_plus_30_and_a_vanished_event_is_a_cancel():
    with AzureMetadata() as server:
        sink = Recorder()
        async with running(azure_source(server, sink)):
            server.set_events([azure_event("e-1", not_before=None)])
            await sink.until(has(Notice))
            assert sink.of(Notice)[0].terminate_at == NOW + 30
            server.set_events([])
            await sink.until(has(Notice, 2))
        assert [(n.action, n.key) for n in sink.of(Notice)] == [
            ("terminate", "azure:e-1"),
            ("cancel", "azure:e-1"),
        ]


async def test_azure_reboot_is_an_advisory_and_malformed_document_invalid():
    with AzureMetadata() as server:
        sink = Recorder()
        async with running(azure_source(server, sink)):
            server.set_events([azure_event("r-1", kind="Reboot", not_before=NOW + 600)])
            await sink.until(has(Advisory))
            server.malformed_next(1, path="/metadata/scheduledevents")
            await sink.until(has(NoticeInvalid))
        assert sink.of(Advisory)[0].reason == "reboot" and not sink.of(Notice)


async def test_azure_dates_as_microsofts_mock_server_and_dotnet_write_them_are_deadlines():
    """The docs write NotBefore as RFC 1123; Microsoft's own mock server writes
    "2026-12-02T18:13:35Z", and .NET's round trip adds seven digits and an offset. Each is the
    event's deadline, to the microsecond."""
    with AzureMetadata() as server:
        sink = Recorder()
        async with running(azure_source(server, sink)):
            server.set_events(
                [
                    azure_event("iso-1", "Terminate", not_before=NOW + 90, style="iso"),
                    azure_event("net-1", not_before=NOW + 60.25, style="iso-fraction"),
                    azure_event("doc-1", not_before=NOW + 30),
                ]
            )
            await sink.until(has(Notice, 3))
        assert {n.key: n.terminate_at for n in sink.of(Notice)} == {
            "azure:iso-1": NOW + 90,
            "azure:net-1": NOW + 60.25,
            "azure:doc-1": NOW + 30,
        }
        assert not sink.of(NoticeInvalid)


async def test_azure_an_unreadable_event_is_reported_and_the_terminate_beside_it_acted_on():
    """A document holds a Terminate for this VM that cannot be read and a good one. The bad one
    is reported on its own, naming it, once however often the document is read; the good one
    is a notice. When the good one later turns unreadable too, it is reported, and it is not
    taken as called off: it is still in the document."""
    with AzureMetadata() as server:
        sink = Recorder()
        events = "/metadata/scheduledevents"
        async with running(azure_source(server, sink)):
            server.set_events(
                [
                    unreadable_event("bad-1"),
                    azure_event("good-1", "Terminate", not_before=NOW + 120),
                ]
            )
            await sink.until(lambda told: has(Notice)(told) and has(NoticeInvalid)(told))
            garbled = {**azure_event("good-1", "Terminate"), "NotBefore": "NaN"}
            server.set_events([unreadable_event("bad-1"), garbled])
            await sink.until(has(NoticeInvalid, 2))
            changed = server.changed_at
            # Barrier: three more reads of the last document, each answered before the next.
            await server.await_seen(lambda s: s.path == events and s.at > changed, count=3)
        notices = [(n.action, n.key, n.terminate_at) for n in sink.of(Notice)]
        assert notices == [("terminate", "azure:good-1", NOW + 120)]
        reasons = [i.reason for i in sink.of(NoticeInvalid)]
        assert len(reasons) == 2, reasons
        assert "event bad-1 (Terminate): NotBefore 'sometime next week' is not a date" in reasons[0]
        assert "event good-1 (Terminate): NotBefore 'NaN' is not a date" in reasons[1]


async def test_azure_acknowledges_only_once_the_node_is_verified_empty():
    with AzureMetadata() as server:
        sink = Recorder()
        async with running(azure_source(server, sink, acknowledge=True)):
            server.set_events([azure_event("p-1"), azure_event("p-2", kind="Terminate")])
            await sink.until(has(Notice, 2))
            assert server.acknowledged == []  # nothing before the drain settles
            sink.settle("azure:p-2", "overrun")  # not empty by our own check: no go-ahead
            sink.settle("azure:p-1", "drained")
            await sink.until(
                lambda told: any(
                    t[0] == "notice_acknowledged" for t in told if isinstance(t, tuple)
                )
            )
        assert server.acknowledged == ["p-1"]


@pytest.mark.parametrize("on_start", ["remove", "start"])
async def test_azure_an_event_that_went_ahead_and_left_is_not_a_cancel(on_start):
    """The node was verified empty and the agent acknowledged the Preempt: the platform goes
    ahead and the event leaves the document (at once, or after showing it Started), long
    before its NotBefore. That is the eviction going ahead, not a provider calling it off: no
    cancel, which would lift the taints of a machine about to vanish."""
    with AzureMetadata(on_start=on_start) as server:
        sink = Recorder()
        events = "/metadata/scheduledevents"
        async with running(azure_source(server, sink, acknowledge=True)):
            server.set_events([azure_event("p-1", not_before=NOW + 30)])
            await sink.until(has(Notice))
            sink.settle("azure:p-1", "drained")
            await sink.until(
                lambda told: ("notice_acknowledged", {"event_id": "p-1", "status": 200}) in told
            )
            if on_start == "start":
                await server.await_seen(
                    lambda s: s.path == events and s.at > server.changed_at, count=3
                )
                server.set_events([])
            changed = server.changed_at
            await server.await_seen(lambda s: s.path == events and s.at > changed, count=3)
        assert [n.action for n in sink.of(Notice)] == ["terminate"]


async def test_azure_refused_then_back():
    with AzureMetadata() as server:
        sink = Recorder()
        async with running(azure_source(server, sink)):
            await server.await_seen(lambda s: s.status == 200, count=2)
            server.refuse()
            await sink.until(lambda told: ("down", "azure") in told)
            server.accept()
            await sink.until(lambda told: ("up", "azure") in told)


# --- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module, table, message",
    [
        (aws, {"endpoint": "169.254.169.254"}, "sources.aws.endpoint must be http://HOST[:PORT]"),
        (aws, {"endpoint": "http://x:99999"}, "sources.aws.endpoint is not a URL"),
        (aws, {"poll_s": float("nan")}, "sources.aws.poll_s must be between"),
        (aws, {"poll_s": 0}, "sources.aws.poll_s must be between"),
        (gcp, {"notice_s": float("inf")}, "sources.gcp.notice_s must be between"),
        (gcp, {"endpont": "http://x"}, "unknown setting sources.gcp.endpont"),
        (azure, {"acknowledge": "yes"}, "sources.azure.acknowledge must be true or false"),
    ],
)
def test_a_bad_source_setting_is_one_clear_error(module, table, message):
    from spotdrain.runtime.cli import UsageError

    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
        module.Config.from_table(table, "")


def test_health_goes_down_after_three_failures_and_backs_off():
    sink = Recorder()
    health = Health("aws", sink, clock=time.time)
    delays = [health.failed("refused") for _ in range(5)]
    assert delays == [0.2, 0.4, 0.8, 1.6, 3.2]
    assert sink.told == [("down", "aws")]
    health.ok()
    assert sink.told == [("down", "aws"), ("up", "aws")] and health.failures == 0


@pytest.mark.parametrize(
    "date, why",
    [
        ("Fri, 31 Dec 9999 23:59:59 GMT", "out of range"),
        ("Fri, 01 Jan 1960 00:00:00 GMT", "out of range"),
        ("9999-12-31T23:59:59Z", "out of range"),
        ("0001-01-01T00:00:00+00:00", "out of range"),
        ("0000-01-01T00:00:00Z", "not a date"),
        ("2026-02-30T10:00:00Z", "not a date"),
        ("2026-12-02T18:13:35+99:00", "not a date"),
        ("NaN", "not a date"),
        (float("nan"), "not a date"),
        (float("inf"), "not a date"),
        (1796235215, "not a date"),
        ("Wed, 02 Dec 2026 18:13:35 GMT" + " " * 100, "not a date"),
    ],
)
def test_azure_not_before_out_of_range_or_unreadable_is_invalid_not_a_deadline(date, why):
    """A NotBefore in year 9999 (or 1960), NaN, infinity, a number, an impossible day, a
    string longer than any date: never a deadline the agent would store and then fail to write
    into the workloads' deadline file. That event is reported; the good one beside it stands."""
    doc = {
        "DocumentIncarnation": 2,
        "Events": [{**azure_event("e-far"), "NotBefore": date}, azure_event("e-good", "Terminate")],
    }
    parsed = azure.parse_document(json.dumps(doc).encode(), "gpu-node-0")
    assert isinstance(parsed, azure.Document)
    assert list(parsed.events) == ["e-good"] and parsed.unreadable == {"e-far"}
    [invalid] = parsed.invalid
    assert invalid.reason.startswith("scheduled events: event e-far (Preempt): NotBefore")
    assert why in invalid.reason and len(invalid.reason) < 200


@pytest.mark.parametrize(
    "date",
    [
        "Mon, 19 Sep 2016 18:29:47 GMT",
        "19 Sep 2016 18:29:47 -0000",
        "2016-09-19T18:29:47Z",
        "2016-09-19T18:29:47",
        "2016-09-19T18:29:47.0000000Z",
        "2016-09-19T20:29:47.000+02:00",
        "2016-09-19T20:29:47+0200",
    ],
)
def test_azure_not_before_in_every_form_azure_writes(date):
    """RFC 1123 (the docs), ISO 8601 with or without fraction or offset (Microsoft's mock
    server, .NET): the same instant. No offset means UTC, as every Azure time is."""
    assert azure.parse_not_before(date) == 1474309787.0


def test_azure_a_broken_event_list_or_another_vms_bad_event():
    """Another VM's unreadable event is not this VM's business; an entry that is not an object
    might be anyone's: reported, and nothing known is taken as called off while it is there."""
    doc = {
        "DocumentIncarnation": 3,
        "Events": [
            {**azure_event("theirs", vm="gpu-node-9"), "NotBefore": "whenever"},
            "junk",
            azure_event("mine"),
        ],
    }
    parsed = azure.parse_document(json.dumps(doc).encode(), "gpu-node-0")
    assert isinstance(parsed, azure.Document) and list(parsed.events) == ["mine"]
    assert [i.reason for i in parsed.invalid] == ["scheduled events: event #1 is not an object"]
    assert parsed.anonymous_unreadable


def test_aws_maintenance_date_out_of_range_is_invalid():
    event = aws_maintenance_event(event_id="instance-event-far")
    event["NotBefore"] = "31 Dec 9999 23:59:59 GMT"
    parsed = aws.parse_maintenance(json.dumps([event]).encode())
    assert isinstance(parsed, NoticeInvalid) and "out of range" in parsed.reason
