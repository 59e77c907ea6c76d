"""The cloud metadata emulators (tests/fakes/cloudmeta.py) against a plain HTTP client: each
documented behaviour and failure mode once, so a notice source's test can trust what it is talking
to."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from fakes import cloudmeta
from fakes.cloudmeta import AwsImds, AzureMetadata, GceMetadata, ManualClock

TTL = "X-aws-ec2-metadata-token-ttl-seconds"
GOOGLE = {"Metadata-Flavor": "Google"}
AZURE = {"Metadata": "true"}
EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
PREEMPTED = "/computeMetadata/v1/instance/preempted"


def call(
    url: str,
    method: str = "GET",
    headers: dict | None = None,
    data: bytes | None = None,
    timeout: float = 10,
) -> tuple[int, dict, bytes]:
    """(status, headers, body); an HTTP error status is an answer, not an exception."""
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def token(aws: AwsImds, ttl: str = "21600") -> str:
    status, headers, body = call(aws.url + cloudmeta.TOKEN_PATH, "PUT", {TTL: ttl})
    assert status == 200 and headers[TTL] == ttl
    return body.decode()


def aws_get(aws: AwsImds, item: str, tok: str | None = None) -> tuple[int, dict, bytes]:
    headers = {cloudmeta.TOKEN_HEADER: tok} if tok is not None else {}
    return call(f"{aws.url}/latest/meta-data/{item}", headers=headers)


@pytest.fixture
def pool():
    with concurrent.futures.ThreadPoolExecutor(4) as executor:
        yield executor


# --- AWS IMDSv2 --------------------------------------------------------------------------------


def test_aws_token_ttl_must_be_1_to_21600_seconds():
    with AwsImds() as aws:
        for bad in ("0", "21601", "-5", "ten", ""):
            status, _, _ = call(aws.url + cloudmeta.TOKEN_PATH, "PUT", {TTL: bad})
            assert status == 400, bad
        assert call(aws.url + cloudmeta.TOKEN_PATH, "PUT")[0] == 400  # the header is required
        for good in ("1", "21600"):
            assert aws_get(aws, "instance-id", token(aws, good))[2] == b"i-0123456789abcdef0"


def test_aws_token_put_elsewhere_or_forwarded_is_forbidden():
    with AwsImds() as aws:
        assert call(aws.url + "/2021-03-23/api/token", "PUT", {TTL: "60"})[0] == 403
        forwarded = {TTL: "60", "X-Forwarded-For": "10.0.0.1"}
        assert call(aws.url + cloudmeta.TOKEN_PATH, "PUT", forwarded)[0] == 403


def test_aws_imdsv1_get_and_bad_tokens_are_401():
    with AwsImds() as aws:
        assert aws_get(aws, "instance-id")[0] == 401  # no token: v1, refused where v2 is required
        assert aws_get(aws, "instance-id", "not-a-token")[0] == 401
        tok = token(aws)
        assert aws_get(aws, "instance-id", tok)[0] == 200
        aws.expire_tokens()
        assert aws_get(aws, "instance-id", tok)[0] == 401
        assert aws.tokens == 0


def test_aws_token_expires_after_its_ttl_on_the_injected_clock():
    clock = ManualClock()
    with AwsImds(clock=clock) as aws:
        tok = token(aws, "10")
        clock.advance(9.5)
        assert aws_get(aws, "instance-id", tok)[0] == 200
        clock.advance(0.5)
        assert aws_get(aws, "instance-id", tok)[0] == 401
        assert aws_get(aws, "instance-id", token(aws, "10"))[0] == 200


def test_aws_fail_token_put_fails_the_next_n_puts_only():
    with AwsImds() as aws:
        held = token(aws)
        aws.fail_token_put(2, status=503)
        assert [call(aws.url + cloudmeta.TOKEN_PATH, "PUT", {TTL: "60"})[0] for _ in range(3)] == [
            503,
            503,
            200,
        ]
        aws.fail_token_put(1)  # default: 403, "not allowed / turned off"
        assert call(aws.url + cloudmeta.TOKEN_PATH, "PUT", {TTL: "60"})[0] == 403
        assert aws_get(aws, "instance-id", held)[0] == 200  # tokens already held still work


def test_aws_instance_action_is_404_until_marked_then_json():
    with AwsImds() as aws:
        tok = token(aws)
        assert aws_get(aws, "spot/instance-action", tok)[0] == 404
        assert aws_get(aws, "spot/termination-time", tok)[0] == 404
        before = time.monotonic()
        aws.set_instance_action("terminate", "2017-09-18T08:22:00Z")
        assert before <= aws.changed_at <= time.monotonic()
        status, headers, body = aws_get(aws, "spot/instance-action", tok)
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        assert json.loads(body) == {"action": "terminate", "time": "2017-09-18T08:22:00Z"}
        assert aws_get(aws, "spot/termination-time", tok)[2] == b"2017-09-18T08:22:00Z"
        aws.set_instance_action("stop")
        action = json.loads(aws_get(aws, "spot/instance-action", tok)[2])
        assert action["action"] == "stop"
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", action["time"])
        aws.clear_instance_action()
        assert aws_get(aws, "spot/instance-action", tok)[0] == 404
        with pytest.raises(ValueError):
            aws.set_instance_action("reboot")


def test_aws_rebalance_recommendation_is_404_until_emitted():
    with AwsImds() as aws:
        tok = token(aws)
        assert aws_get(aws, "events/recommendations/rebalance", tok)[0] == 404
        aws.set_rebalance("2020-10-27T08:22:00Z")
        body = aws_get(aws, "events/recommendations/rebalance", tok)[2]
        assert json.loads(body) == {"noticeTime": "2020-10-27T08:22:00Z"}
        aws.clear_rebalance()
        assert aws_get(aws, "events/recommendations/rebalance", tok)[0] == 404


def test_aws_re_stamps_time_and_notice_time_on_every_read_when_told():
    """As amazon-ec2-metadata-mock does by default: a new time on every read."""
    wall = iter(range(1_800_000_000, 1_800_000_100))
    with AwsImds(wall=lambda: float(next(wall))) as aws:
        tok = token(aws)
        aws.set_instance_action("terminate", restamp_in_s=120)
        aws.set_rebalance(restamp=True)
        times = [json.loads(aws_get(aws, "spot/instance-action", tok)[2])["time"] for _ in range(2)]
        assert times == [cloudmeta.iso_utc(1_800_000_120), cloudmeta.iso_utc(1_800_000_121)]
        notice = json.loads(aws_get(aws, "events/recommendations/rebalance", tok)[2])
        assert notice == {"noticeTime": cloudmeta.iso_utc(1_800_000_002)}


@pytest.mark.parametrize("how", ["split", "chunked", "trickle"])
def test_a_paced_answer_arrives_whole_and_late(how):
    """split_next / trickle_next change when the bytes arrive, never what they are."""
    with AwsImds() as aws:
        tok = token(aws)
        aws.set_instance_action("terminate", "2017-09-18T08:22:00Z")
        _, _, whole = aws_get(aws, "spot/instance-action", tok)
        if how == "trickle":
            aws.trickle_next(1, path="/latest/meta-data/spot/instance-action", every_s=0.01)
        else:
            aws.split_next(
                1,
                path="/latest/meta-data/spot/instance-action",
                gap_s=0.15,
                chunked=how == "chunked",
            )
        started = time.monotonic()
        status, headers, body = aws_get(aws, "spot/instance-action", tok)
        took = time.monotonic() - started
        assert status == 200 and body == whole
        assert took >= (0.01 * (len(whole) - 1) if how == "trickle" else 0.15)
        assert ("Transfer-Encoding" in headers) == (how == "chunked")
        assert aws_get(aws, "spot/instance-action", tok)[2] == whole  # the next one is not paced


def test_aws_scheduled_maintenance_is_a_json_list():
    with AwsImds() as aws:
        tok = token(aws)
        assert json.loads(aws_get(aws, "events/maintenance/scheduled", tok)[2]) == []
        event = cloudmeta.aws_maintenance_event("instance-stop", event_id="instance-event-1")
        aws.set_maintenance([event])
        [got] = json.loads(aws_get(aws, "events/maintenance/scheduled", tok)[2])
        assert got == event and set(got) == {
            "Code",
            "EventId",
            "NotBefore",
            "NotAfter",
            "State",
            "Description",
        }
        assert re.fullmatch(r"\d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT", got["NotBefore"])


# --- GCE metadata server -----------------------------------------------------------------------


def test_gce_requires_metadata_flavor_and_answers_with_it():
    with GceMetadata() as gce:
        for headers in ({}, {"Metadata-Flavor": "google-ish"}):
            status, answer, _ = call(gce.url + PREEMPTED, headers=headers)
            assert status == 403 and answer["Metadata-Flavor"] == "Google"
        status, answer, body = call(gce.url + PREEMPTED, headers=GOOGLE)
        assert (status, body) == (200, b"FALSE")
        assert answer["Metadata-Flavor"] == "Google" and answer["ETag"] == gce.etag("preempted")


def test_gce_impostor_answers_without_metadata_flavor():
    """Something else on the metadata address: it answers any request, echoing no flavor."""
    with GceMetadata() as gce:
        gce.set_preempted(True)
        gce.impostor()
        for headers in ({}, GOOGLE):
            status, answer, body = call(gce.url + PREEMPTED, headers=headers)
            assert (status, body) == (200, b"TRUE") and "Metadata-Flavor" not in answer
        gce.impostor(False)
        assert call(gce.url + PREEMPTED, headers=GOOGLE)[1]["Metadata-Flavor"] == "Google"


def test_gce_values_and_etags():
    with GceMetadata(instance_id="42", name="vm-a") as gce:
        base = gce.url + "/computeMetadata/v1/instance/"
        assert call(base + "id", headers=GOOGLE)[2] == b"42"
        assert call(base + "name", headers=GOOGLE)[2] == b"vm-a"
        assert call(base + "maintenance-event", headers=GOOGLE)[2] == b"NONE"
        assert call(base + "no-such-key", headers=GOOGLE)[0] == 404
        first = gce.etag("maintenance-event")
        gce.set_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE")
        status, headers, body = call(base + "maintenance-event", headers=GOOGLE)
        assert body == b"TERMINATE_ON_HOST_MAINTENANCE" and headers["ETag"] != first
        with pytest.raises(ValueError):
            gce.set_maintenance_event("SHUTDOWN")


def test_gce_hanging_get_returns_at_the_change_with_the_new_etag(pool):
    with GceMetadata() as gce:
        etag = gce.etag("preempted")
        url = f"{gce.url}{PREEMPTED}?wait_for_change=true&last_etag={etag}"
        answer = pool.submit(call, url, headers=GOOGLE)
        gce.wait_hanging(1)
        assert not answer.done() and gce.seen[-1].status is None
        gce.set_preempted(True)
        status, headers, body = answer.result(10)
        assert (status, body) == (200, b"TRUE")
        assert headers["ETag"] == gce.etag("preempted") != etag
        assert gce.seen[-1].at <= gce.changed_at


def test_gce_hanging_get_without_last_etag_waits_for_the_next_change(pool):
    with GceMetadata() as gce:
        gce.set_preempted(True)
        answer = pool.submit(call, f"{gce.url}{PREEMPTED}?wait_for_change=true", headers=GOOGLE)
        gce.wait_hanging(1)
        gce.set_preempted(False)
        assert answer.result(10)[2] == b"FALSE"


def test_gce_stale_last_etag_answers_at_once():
    with GceMetadata() as gce:
        gce.set_preempted(True)
        url = f"{gce.url}{PREEMPTED}?wait_for_change=true&last_etag=0"
        status, headers, body = call(url, headers=GOOGLE, timeout=5)
        assert (status, body, headers["ETag"]) == (200, b"TRUE", gce.etag("preempted"))
        assert gce.hanging == 0


def test_gce_timeout_sec_ends_the_hang_with_the_same_etag():
    with GceMetadata() as gce:
        etag = gce.etag("preempted")
        started = time.monotonic()
        url = f"{gce.url}{PREEMPTED}?wait_for_change=true&last_etag={etag}&timeout_sec=1"
        status, headers, body = call(url, headers=GOOGLE)
        assert time.monotonic() - started >= 1
        assert (status, body, headers["ETag"]) == (200, b"FALSE", etag)
        for bad in ("0", "x", "-1"):
            url = f"{gce.url}{PREEMPTED}?wait_for_change=true&timeout_sec={bad}"
            assert call(url, headers=GOOGLE)[0] == 400


def test_gce_end_hanging_early_answers_unchanged_with_the_same_etag(pool):
    with GceMetadata() as gce:
        etag = gce.etag("preempted")
        url = f"{gce.url}{PREEMPTED}?wait_for_change=true&last_etag={etag}"
        answers = [pool.submit(call, url, headers=GOOGLE) for _ in range(2)]
        gce.wait_hanging(2)
        assert gce.end_hanging_early() == 2
        for answer in answers:
            status, headers, body = answer.result(10)
            assert (status, body, headers["ETag"]) == (200, b"FALSE", etag)
        assert gce.hanging == 0


def test_gce_refuse_resets_a_hanging_get_and_close_answers_one(pool):
    gce = GceMetadata()
    url = f"{gce.url}{PREEMPTED}?wait_for_change=true"
    reset = pool.submit(call, url, headers=GOOGLE)
    gce.wait_hanging(1)
    gce.refuse()
    with pytest.raises((ConnectionError, urllib.error.URLError)):
        reset.result(10)
    gce.accept()
    answered = pool.submit(call, url, headers=GOOGLE)
    # the reset GET was never answered (status None); wait for the second one to arrive
    gce.wait_seen(lambda s: s.status is None and s.query.get("wait_for_change") == "true", count=2)
    gce.close()
    assert answered.result(10)[:1] == (200,)


async def test_gce_from_an_async_test_hang_and_change():
    """The emulator's own loop serves while the test's loop awaits a hanging GET."""
    with GceMetadata() as gce:
        async with aiohttp.ClientSession() as session:
            params = {"wait_for_change": "true", "last_etag": gce.etag("preempted")}

            async def hang() -> tuple[str, str]:
                async with session.get(
                    gce.url + PREEMPTED, headers=GOOGLE, params=params
                ) as response:
                    return await response.text(), response.headers["ETag"]

            task = asyncio.create_task(hang())
            await gce.await_hanging(1)
            assert not task.done()
            gce.set_preempted(True)
            assert await asyncio.wait_for(task, 10) == ("TRUE", gce.etag("preempted"))
            [seen] = await gce.await_seen(lambda s: s.query.get("wait_for_change") == "true")
            assert seen.headers["metadata-flavor"] == "Google" and seen.status == 200


# --- Azure IMDS and Scheduled Events ------------------------------------------------------------


def test_azure_requires_metadata_header_and_api_version():
    with AzureMetadata() as azure:
        assert call(azure.url + EVENTS)[0] == 400
        assert call(azure.url + EVENTS, headers={"Metadata": "false"})[0] == 400
        forwarded = {**AZURE, "X-Forwarded-For": "10.0.0.1"}
        assert call(azure.url + EVENTS, headers=forwarded)[0] == 400
        status, _, body = call(azure.url + "/metadata/scheduledevents", headers=AZURE)
        assert status == 400 and "api-version" in json.loads(body)["error"]
        assert json.loads(body)["newest-versions"][0] == "2020-07-01"
        assert call(azure.url + EVENTS + "&api-version=2020-07-01", headers=AZURE)[0] == 400
        assert call(azure.url + EVENTS, "PUT", AZURE, b"")[0] == 405


def test_azure_document_and_incarnation():
    with AzureMetadata() as azure:
        status, headers, body = call(azure.url + EVENTS, headers=AZURE)
        assert status == 200 and headers["Content-Type"].startswith("application/json")
        assert json.loads(body) == {"DocumentIncarnation": 1, "Events": []}
        event = cloudmeta.azure_event("E1", resources=["gpu-node-0", "gpu-node-1"])
        azure.set_events([event])
        doc = json.loads(call(azure.url + EVENTS, headers=AZURE)[2])
        assert doc == {"DocumentIncarnation": 2, "Events": [event]}
        assert set(event) == {
            "EventId",
            "EventType",
            "ResourceType",
            "Resources",
            "EventStatus",
            "NotBefore",
            "Description",
            "EventSource",
            "DurationInSeconds",
        }
        assert re.fullmatch(
            r"[A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT", event["NotBefore"]
        )
        azure.set_events([dict(event)])  # the same list: the incarnation stays
        assert json.loads(call(azure.url + EVENTS, headers=AZURE)[2])["DocumentIncarnation"] == 2
        azure.bump_incarnation()  # moves without a change to this VM's events
        doc = json.loads(call(azure.url + EVENTS, headers=AZURE)[2])
        assert doc == {"DocumentIncarnation": 3, "Events": [event]}
        azure.set_events([])
        assert azure.document() == {"DocumentIncarnation": 4, "Events": []}


def test_azure_dates_in_each_form_azure_writes_and_an_unreadable_event():
    """NotBefore as the docs write it, as Microsoft's mock server writes it, and as .NET's
    round trip does; an unreadable event beside them makes a mixed document."""
    when = 1_796_235_215.25  # 2026-12-02 18:13:35.25 UTC
    forms = {
        style: cloudmeta.azure_event(style, not_before=when, date_style=style)["NotBefore"]
        for style in cloudmeta.AZURE_DATE_STYLES
    }
    assert forms == {
        "rfc1123": "Wed, 02 Dec 2026 18:13:35 GMT",
        "iso": "2026-12-02T18:13:35Z",
        "iso-fraction": "2026-12-02T18:13:35.2500000+00:00",
    }
    with AzureMetadata() as azure:
        bad = cloudmeta.unreadable_event("E0")
        good = cloudmeta.azure_event("E1", event_type="Terminate", date_style="iso")
        azure.set_events([bad, good])
        doc = json.loads(call(azure.url + EVENTS, headers=AZURE)[2])
        assert doc["Events"] == [bad, good] and bad["NotBefore"] == "sometime next week"


def test_azure_post_start_requests_acknowledges_and_starts_the_event():
    with AzureMetadata() as azure:
        azure.set_events([cloudmeta.azure_event("E1"), cloudmeta.azure_event("E2")])
        body = json.dumps({"StartRequests": [{"EventId": "E1"}]}).encode()
        assert call(azure.url + EVENTS, "POST", AZURE, body)[0] == 200
        assert azure.acknowledged == ["E1"]
        doc = json.loads(call(azure.url + EVENTS, headers=AZURE)[2])
        assert doc["DocumentIncarnation"] == 3
        first, second = doc["Events"]
        assert (first["EventStatus"], first["NotBefore"]) == ("Started", "")
        assert second["EventStatus"] == "Scheduled"
        [post] = azure.wait_seen(lambda s: s.method == "POST")
        assert json.loads(post.body) == {"StartRequests": [{"EventId": "E1"}]}
        for bad in (
            b"{",
            b"{}",
            b'{"StartRequests": [{"Id": "E1"}]}',
            b'{"StartRequests": [{"EventId": "nope"}]}',
        ):
            assert call(azure.url + EVENTS, "POST", AZURE, bad)[0] == 400, bad
        assert call(azure.url + EVENTS, "POST", {}, body)[0] == 400  # header still required
        assert azure.acknowledged == ["E1"]


def test_azure_start_requests_can_remove_the_event():
    with AzureMetadata(on_start="remove") as azure:
        azure.set_events([cloudmeta.azure_event("E1")])
        body = json.dumps({"StartRequests": [{"EventId": "E1"}]}).encode()
        assert call(azure.url + EVENTS, "POST", AZURE, body)[0] == 200
        assert azure.document() == {"DocumentIncarnation": 3, "Events": []}


def test_azure_compute_name_tells_this_vm():
    with AzureMetadata(vm_name="vm-a") as azure:
        name = "/metadata/instance/compute/name?api-version=2021-02-01"
        status, headers, body = call(azure.url + name + "&format=text", headers=AZURE)
        assert (status, body) == (200, b"vm-a") and headers["Content-Type"].startswith("text/")
        assert call(azure.url + name, headers=AZURE)[0] == 400  # a leaf needs format=text
        assert (
            call(azure.url + "/metadata/instance/compute/name?format=text", headers=AZURE)[0] == 400
        )  # api-version is mandatory here too
        assert call(azure.url + name + "&format=text")[0] == 400
        compute = "/metadata/instance/compute?api-version=2021-02-01"
        assert json.loads(call(azure.url + compute, headers=AZURE)[2])["name"] == "vm-a"
        azure.set_vm_name("vm-b")
        assert call(azure.url + name + "&format=text", headers=AZURE)[2] == b"vm-b"
        azure.set_events([cloudmeta.azure_event("E1", resources=["vm-c"])])
        assert "vm-b" not in azure.document()["Events"][0]["Resources"]


# --- what all three share -----------------------------------------------------------------------


def _aws_read(aws: AwsImds) -> tuple[str, dict]:
    return "/latest/meta-data/events/maintenance/scheduled", {cloudmeta.TOKEN_HEADER: token(aws)}


READS = {
    AwsImds: _aws_read,
    GceMetadata: lambda gce: (PREEMPTED, GOOGLE),
    AzureMetadata: lambda azure: (EVENTS, AZURE),
}
CLOUDS = pytest.mark.parametrize("cls", list(READS), ids=["aws", "gcp", "azure"])


@CLOUDS
def test_refuse_then_accept_on_the_same_port(cls):
    with cls() as emu:
        path, headers = READS[cls](emu)
        port, url = emu.port, emu.url
        emu.refuse()
        with pytest.raises(urllib.error.URLError) as refused:
            call(url + path, headers=headers)
        assert isinstance(refused.value.reason, ConnectionRefusedError)
        emu.refuse()  # twice is harmless
        emu.accept()
        assert emu.port == port and emu.url == url
        assert call(url + path, headers=headers)[0] == 200


@CLOUDS
def test_fail_next_answers_5xx_for_the_next_n(cls):
    with cls() as emu:
        path, headers = READS[cls](emu)
        emu.fail_next(2, status=503)
        assert [call(emu.url + path, headers=headers)[0] for _ in range(3)] == [503, 503, 200]
        emu.fail_next(1, status=500, path="/elsewhere")  # only for that path
        assert call(emu.url + path, headers=headers)[0] == 200
        assert call(emu.url + "/elsewhere", headers=headers)[0] == 500


@CLOUDS
def test_malformed_next_corrupts_the_next_n_bodies(cls):
    with cls() as emu:
        path, headers = READS[cls](emu)
        good = call(emu.url + path, headers=headers)[2]
        emu.malformed_next(1, path=path.split("?")[0])
        status, _, bad = call(emu.url + path, headers=headers)
        assert status == 200 and bad != good
        with pytest.raises(ValueError):  # neither JSON nor even UTF-8
            json.loads(bad.decode())
        assert call(emu.url + path, headers=headers)[2] == good


@CLOUDS
def test_the_log_records_what_the_client_sent(cls):
    with cls() as emu:
        path, headers = READS[cls](emu)
        emu.clear_seen()
        before = time.monotonic()
        call(emu.url + path, headers={**headers, "X-Probe": "1"})
        [seen] = emu.seen
        assert (seen.method, seen.path, seen.status) == ("GET", path.split("?")[0], 200)
        assert seen.headers["x-probe"] == "1" and before <= seen.at <= time.monotonic()
        assert dict(seen.query) == dict(urllib.parse.parse_qsl(path.partition("?")[2]))


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_cli_serves_one_emulator_until_killed(cloud):
    script = Path(__file__).with_name("cloudmeta.py")
    with subprocess.Popen(
        [sys.executable, str(script), cloud, "--port", "0"], stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            url = proc.stdout.readline().strip()
            assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
            status = call(url + "/", timeout=5)[0]
            assert status in (401, 403, 400)  # answered; refused for lack of the cloud's header
        finally:
            proc.terminate()
            assert proc.wait(10) == 0


def test_cli_control_channel_calls_setters_and_stamps_the_change_on_the_wall_clock():
    """--control: one JSON call a line on stdin, one answer a line; a setter's answer carries
    the time.time() at which the change became visible; private names and mistakes are
    answered with an error, not fatal; end of input stops it."""
    script = Path(__file__).with_name("cloudmeta.py")
    with subprocess.Popen(
        [sys.executable, str(script), "gcp", "--control"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:

        def ask(request: dict) -> dict:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
            return json.loads(proc.stdout.readline())

        url = proc.stdout.readline().strip()
        assert ask({"call": "value", "args": ["preempted"]}) == {
            "result": "FALSE",
            "changed_wall": None,
        }
        before = time.time()
        answer = ask({"call": "set_preempted", "args": [True]})
        assert answer["result"] is None and before <= answer["changed_wall"] <= time.time()
        status, _, body = call(
            url + "/computeMetadata/v1/instance/preempted", headers={"Metadata-Flavor": "Google"}
        )
        assert (status, body) == (200, b"TRUE")
        assert ask({"call": "hanging"})["result"] == 0
        assert [s["status"] for s in ask({"call": "seen"})["result"]] == [200]
        assert "no public member" in ask({"call": "_values"})["error"]
        assert "TypeError" in ask({"call": "set_preempted"})["error"]
        proc.stdin.close()
        assert proc.wait(10) == 0
