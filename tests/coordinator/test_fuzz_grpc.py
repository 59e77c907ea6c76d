"""Every gRPC method of every service, fuzzed against one real coordinator (SQLite, mutual
TLS) as an operator, a node and a router would call it: messages built by Hypothesis from the
proto descriptors (strings huge, unicode or with NUL, numbers NaN, infinite or at their
extremes, repeated fields of thousands, nested messages) and raw bodies (random bytes, and
valid messages cut short or with a byte flipped), sent through a generic channel. A method
added to the proto is fuzzed without touching this file.

What must hold, whatever comes in: no call ends UNKNOWN or INTERNAL (a servicer exception),
the process is alive after each method, and at the end it still serves (health SERVING, a
node's Taint lands), its log holds no traceback, no "Task was destroyed", and at most one
rejection line per peer a minute, every rejection the clients saw is counted in
spotdrain_rpc_rejected_total, and its memory grew by less than RSS_GROWTH_BOUND.

Bounded for CI (derandomized there, so a run is reproducible from its seed); more examples on
demand: SPOTDRAIN_FUZZ_EXAMPLES=2000 pytest tests/coordinator/test_fuzz_grpc.py.
"""

from __future__ import annotations

import collections
import math
import os
import re
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor as pbd
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fakes.fakenode import FakeNode
from fakes.harness import Coordinator, start_coordinator
from fakes.pki import CertFiles, Pki
from fakes.waiting import wait_until
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

CI = os.environ.get("CI") == "true"
# Examples per method for generated messages (half that for raw bodies): 150 is about 1.5
# minutes for the whole module on two cores.
EXAMPLES = int(os.environ.get("SPOTDRAIN_FUZZ_EXAMPLES", "150"))
RSS_GROWTH_BOUND = 200 * 1024 * 1024
NODE_ID = "fuzz-node"
UNARY_TIMEOUT_S = 10.0
# A watch with follow never ends by itself: a few answers or this long, then it is closed.
STREAM_TIMEOUT_S = 0.5
STREAM_READS = 3
# What a servicer exception looks like to a client: never acceptable.
CRASH_CODES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
REJECTED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INTERNAL,
)

METHODS = [
    method for service in pb.DESCRIPTOR.services_by_name.values() for method in service.methods
]


def method_id(method: pbd.MethodDescriptor) -> str:
    return f"{method.containing_service.name}.{method.name}"


# --- strategies from descriptors ------------------------------------------------------------

FD = pbd.FieldDescriptor
INT_RANGES = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FD.TYPE_ENUM: (-(2**31), 2**31 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1),
    FD.TYPE_FIXED64: (0, 2**64 - 1),
}
# Names the coordinator knows, so that some calls get past "no such node" into the code below.
KNOWN = [
    "",
    NODE_ID,
    "node-b",
    "model-a",
    "rcl-1",
    "notice",
    "pause",
    "inference",
    "batch",
    "platform",
    "renter",
    "started",
    "stopped",
    "refused",
    "drained",
    "notice_received",
    "tainted",
    '{"t0": 1e400}',
    '{"n": ' + "9" * 500 + "}",
    "[" * 2000,
    "/".join(["..", "..", "etc", "passwd"]),
]  # a traversal, built so no file names it
# Proto strings are UTF-8: a lone surrogate cannot be sent at all, so it is left out.
CHARS = st.characters(exclude_categories=("Cs",))
SPECIAL_FLOATS = [
    math.nan,
    math.inf,
    -math.inf,
    0.0,
    -0.0,
    1e308,
    -1e308,
    5e-324,
    2.0**63,
    1.7e9,
    4e9,
]


def strings(small: bool) -> st.SearchStrategy[str]:
    few = st.one_of(
        st.sampled_from(KNOWN),
        st.text(CHARS, max_size=40),
        st.text(st.sampled_from("\x00\n\r\t\"'\\%{}[]/:é漢🙂\u202e\ufeff"), max_size=40),
    )
    if small:
        return few
    # Huge, cheaply: a short piece repeated (Hypothesis's own buffer stays small). The
    # largest pass the 4 MiB message limit now and then.
    return st.one_of(
        few,
        st.builds(
            lambda piece, n: piece * n,
            st.text(CHARS, min_size=1, max_size=4),
            st.sampled_from([257, 10_000, 70_000, 400_000]),
        ),
    )


def scalars(f: pbd.FieldDescriptor, small: bool = False) -> st.SearchStrategy:
    if f.type == FD.TYPE_STRING:
        return strings(small)
    if f.type == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    if f.type == FD.TYPE_BOOL:
        return st.booleans()
    if f.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        width = 64 if f.type == FD.TYPE_DOUBLE else 32
        return st.one_of(
            st.sampled_from(SPECIAL_FLOATS if width == 64 else SPECIAL_FLOATS[:6]),
            st.floats(width=width),
        )
    lo, hi = INT_RANGES[f.type]
    return st.one_of(st.sampled_from([lo, hi, 0, 1, max(lo, -1)]), st.integers(lo, hi))


def many(f: pbd.FieldDescriptor, depth: int, small: bool) -> st.SearchStrategy[list]:
    """A repeated field: a few elements, or a few small ones repeated into thousands (huge
    elements are never repeated: the client must not build a gigabyte)."""
    few = st.lists(value_of(f, depth, small), max_size=4)
    if small:
        return few
    thousands = st.builds(
        lambda items, times: items * times,
        st.lists(value_of(f, depth, small=True), min_size=1, max_size=4),
        st.sampled_from([200, 1000]),
    )
    return st.one_of(few, few, thousands)


def messages(descriptor: pbd.Descriptor, depth: int = 0, small: bool = False) -> st.SearchStrategy:
    cls = message_factory.GetMessageClass(descriptor)
    fields: dict[str, st.SearchStrategy] = {}
    for f in descriptor.fields:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            entry = f.message_type.fields_by_name
            key, value = entry["key"], entry["value"]
            fields[f.name] = st.dictionaries(
                scalars(key, small), value_of(value, depth, small), max_size=5
            )
        elif f.is_repeated:
            fields[f.name] = many(f, depth, small)
        else:
            fields[f.name] = value_of(f, depth, small)
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


def value_of(f: pbd.FieldDescriptor, depth: int, small: bool) -> st.SearchStrategy:
    if f.message_type is None:
        return scalars(f, small)
    if depth >= 3:
        return st.just(message_factory.GetMessageClass(f.message_type)())
    return st.deferred(lambda: messages(f.message_type, depth + 1, small))


def raw_bodies(descriptor: pbd.Descriptor) -> st.SearchStrategy[bytes]:
    """Bytes that are not (quite) a message: random, a valid one cut short, one byte flipped,
    garbage appended."""

    def mutate(body: bytes, how: str, at: int, junk: bytes) -> bytes:
        i = at % (len(body) + 1)
        if how == "cut":
            return body[:i]
        if how == "flip" and body:
            i %= len(body)
            return body[:i] + bytes([body[i] ^ 0xFF]) + body[i + 1 :]
        return body + junk

    valid = messages(descriptor).map(lambda m: m.SerializeToString())
    return st.one_of(
        st.binary(max_size=512),
        st.builds(
            mutate,
            valid,
            st.sampled_from(["cut", "flip", "append"]),
            st.integers(0, 2**16),
            st.binary(min_size=1, max_size=32),
        ),
    )


# --- the coordinator under fuzz, and what the clients saw ------------------------------------


@dataclass
class Fuzzed:
    coordinator: Coordinator
    pki: Pki
    identities: dict[str, CertFiles]
    channels: dict[str, grpc.Channel]
    metrics_url: str
    rss_before: int
    started: float
    codes: collections.Counter = field(default_factory=collections.Counter)
    rejected: collections.Counter = field(default_factory=collections.Counter)  # (path, code)
    calls: int = 0


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("fuzz")
    pki = Pki(work / "pki")
    coordinator = start_coordinator(
        work / "coordinator", tls=pki, extra=("--metrics-listen", "127.0.0.1:0")
    )
    try:
        metrics = wait_until(
            lambda: re.search(r"metrics on (\S+)", coordinator.proc.log()),
            10,
            "the metrics address",
        )
        identities = {
            "operator": coordinator.operator,
            "node": pki.issue(f"node:{NODE_ID}"),
            "router": pki.issue("router:fuzz"),
        }
        channels = {who: coordinator.channel(ident) for who, ident in identities.items()}
        # One ordinary call first, so the baseline is a coordinator that has served.
        pb_grpc.AdminStub(channels["operator"]).ListNodes(pb.ListNodesRequest(), timeout=10)
        yield Fuzzed(
            coordinator,
            pki,
            identities,
            channels,
            f"http://{metrics.group(1)}/metrics",
            rss_bytes(coordinator.proc.pid),
            time.monotonic(),
        )
        for channel in channels.values():
            channel.close()
    finally:
        coordinator.proc.stop()


def call(fuzzed: Fuzzed, who: str, method: pbd.MethodDescriptor, bodies: list[bytes]) -> None:
    """One call with these request bodies (one, unless the method streams requests); the code
    it ended with is recorded, and must not be a crash's."""
    channel = fuzzed.channels[who]
    path = f"/{method.containing_service.full_name}/{method.name}"
    same = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        if method.client_streaming:
            responses = channel.stream_stream(path, **same)(iter(bodies), timeout=STREAM_TIMEOUT_S)
            read(responses)
        elif method.server_streaming:
            read(channel.unary_stream(path, **same)(bodies[0], timeout=STREAM_TIMEOUT_S))
        else:
            channel.unary_unary(path, **same)(bodies[0], timeout=UNARY_TIMEOUT_S)
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
        assert code not in CRASH_CODES, f"{path} as {who}: {code.name}: {e.details()}"
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (e.details() or ""):
            code = "over the message limit"  # refused by gRPC itself, before any servicer
    fuzzed.calls += 1
    fuzzed.codes[code] += 1
    if code in REJECTED:
        fuzzed.rejected[(path, code.name)] += 1


def read(responses) -> None:  # noqa: ANN001 (a grpc streaming call)
    for i, _ in enumerate(responses):
        if i + 1 >= STREAM_READS:
            responses.cancel()
            return


def fuzz_settings(examples: int):
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=CI,
        database=None if CI else settings.default.database,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )


WHO = st.sampled_from(["operator", "node", "router"])


@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_generated_messages_never_crash_a_method(fuzzed: Fuzzed, method):
    """Each method with messages of its own request type, as each identity: refused or
    answered, never a servicer exception."""
    body = messages(method.input_type)
    if method.client_streaming:
        bodies = st.lists(body, min_size=1, max_size=4)
        # Some streams start as a registered agent would, to fuzz what follows registration.
        register = pb.AgentMessage(register=pb.Register(node_id=NODE_ID))
        bodies = st.one_of(bodies, bodies.map(lambda b: [register, *b]))
    else:
        bodies = body.map(lambda m: [m])

    @fuzz_settings(EXAMPLES)
    @given(who=WHO, requests=bodies)
    def fuzz(who, requests):
        call(fuzzed, who, method, [m.SerializeToString() for m in requests])

    fuzz()
    assert fuzzed.coordinator.proc.popen.poll() is None, "the coordinator exited"


@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_raw_bodies_never_crash_a_method(fuzzed: Fuzzed, method):
    """Bytes that are not a message of the method's type: INVALID_ARGUMENT (or a refusal of
    whatever they happen to decode to), never UNKNOWN."""
    bodies = st.lists(
        raw_bodies(method.input_type), min_size=1, max_size=3 if method.client_streaming else 1
    )

    @fuzz_settings(max(10, EXAMPLES // 2))
    @given(who=WHO, raw=bodies)
    def fuzz(who, raw):
        call(fuzzed, who, method, raw)

    fuzz()
    assert fuzzed.coordinator.proc.popen.poll() is None, "the coordinator exited"


def rejected_counted(metrics_url: str) -> dict[tuple[str, str], float]:
    """spotdrain_rpc_rejected_total from the coordinator's /metrics, by (path, code)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    counted = {}
    for sample in re.finditer(r"^spotdrain_rpc_rejected_total\{(.*)\} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', sample.group(1)))
        path = f"/{labels['service']}/{labels['method']}"
        counted[(path, labels["code"])] = float(sample.group(2))
    return counted


async def test_the_coordinator_still_serves_after_the_fuzz(fuzzed: Fuzzed):
    """After every method was fuzzed (the tests above run first, in file order): health says
    SERVING, a node connects and its Taint lands, the log has no traceback and no more than
    one rejection line per peer a minute, every rejection seen was counted, and memory is
    bounded."""
    coordinator = fuzzed.coordinator
    assert coordinator.proc.popen.poll() is None
    health = health_pb2_grpc.HealthStub(fuzzed.channels["operator"])
    answer = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING

    node = FakeNode(coordinator, fuzzed.pki, "after-fuzz")
    try:
        await node.connect()
        reply = await node.stub.Taint(
            pb.TaintRequest(
                node_id="after-fuzz",
                reclaim_id="rcl-after",
                reason="notice",
                terminate_at=time.time() + 120,
                grace_deadline=time.time() + 110,
            ),
            timeout=10,
        )
        assert [t.reclaim_id for t in reply.taints] == ["rcl-after"]
    finally:
        await node.close()

    log = coordinator.proc.log()
    assert "Traceback" not in log
    assert "Task was destroyed" not in log
    elapsed_min = (time.monotonic() - fuzzed.started) / 60
    lines = len(re.findall(r" rejected /spotdrain", log))
    # All clients here share one host: one line a minute, plus the first.
    assert lines <= math.ceil(elapsed_min) + 1, f"{lines} rejection lines in {elapsed_min:.1f} min"
    # Each rejection a client saw is counted under its method and code (a stream closed
    # after its last read may be counted without the client seeing it).
    counted = rejected_counted(fuzzed.metrics_url)
    assert fuzzed.rejected, "the fuzz met no rejection at all: it reached nothing"
    short = {
        key: (n, counted.get(key, 0))
        for key, n in fuzzed.rejected.items()
        if counted.get(key, 0) < n
    }
    assert not short, f"rejections seen by clients but not counted (seen, counted): {short}"

    growth = rss_bytes(coordinator.proc.pid) - fuzzed.rss_before
    print(
        f"fuzz: {fuzzed.calls} calls in {elapsed_min * 60:.0f} s, "
        f"{dict((getattr(c, 'name', c), n) for c, n in fuzzed.codes.most_common())}, "
        f"RSS {fuzzed.rss_before / 2**20:.0f} MiB -> +{growth / 2**20:.0f} MiB, "
        f"log {len(log)} bytes, {lines} rejection lines"
    )
    assert growth < RSS_GROWTH_BOUND
