"""Malformed requests are counted and logged without flooding: the rate limiter on a fake
clock, and the guard in front of a real gRPC server (in-process, port 0) whose methods fail in
every way a servicer can."""

from __future__ import annotations

import collections
import gc
import logging

import grpc
import pytest
from prometheus_client import CollectorRegistry

from spotdrain.coordinator.api.errors import BadRequest, grpc_errors
from spotdrain.coordinator.api.rejections import (
    OTHER_PEERS,
    LogLimiter,
    RejectionGuard,
    peer_host,
)
from spotdrain.v1 import spotdrain_pb2 as pb


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_peer_a_minute_and_the_held_back_ones_counted():
    """A client sends garbage in a loop: its first rejection is logged, the rest of that
    minute is not; the next line says how many were held back."""
    clock = FakeClock()
    limiter = LogLimiter(window_s=60, clock=clock)
    assert limiter.admit("ipv4:10.0.0.7") == 0
    assert [limiter.admit("ipv4:10.0.0.7") for _ in range(5)] == [None] * 5
    assert limiter.admit("ipv4:10.0.0.8") == 0  # another peer has its own budget
    clock.now += 59.9
    assert limiter.admit("ipv4:10.0.0.7") is None
    clock.now += 0.1
    assert limiter.admit("ipv4:10.0.0.7") == 6
    assert limiter.admit("ipv4:10.0.0.7") is None


def test_a_flood_of_peers_keeps_the_limiter_bounded():
    """More peers than the table holds share one budget until their windows run out; then
    they are forgotten and each has its own again."""
    clock = FakeClock()
    limiter = LogLimiter(window_s=60, max_keys=3, clock=clock)
    assert [limiter.admit(f"peer-{i}") for i in range(3)] == [0, 0, 0]
    assert limiter.admit("peer-3") == 0  # the first of the overflow, under OTHER_PEERS
    assert limiter.admit("peer-4") is None
    assert len(limiter) == 4 and OTHER_PEERS in limiter._last
    clock.now += 61
    assert limiter.admit("peer-5") == 0  # the old ones forgotten: a budget of its own
    assert len(limiter) == 1


@pytest.mark.parametrize(
    "peer, host",
    [
        ("ipv4:127.0.0.1:51234", "ipv4:127.0.0.1"),
        ("ipv6:[::1]:443", "ipv6:[::1]"),
        ("unix:/run/spotdrain.sock", "unix:/run/spotdrain.sock"),
        ("dashboard", "dashboard"),
    ],
)
def test_a_peer_is_its_host_not_its_port(peer, host):
    assert peer_host(peer) == host


# --- the guard in front of a real server ------------------------------------------------------

SERVICE = "test.Faulty"


class Faulty:
    """Methods that fail as a servicer can: a domain error through grpc_errors, an exception
    with no decorator at all, one out of a stream after a first answer."""

    @grpc_errors
    async def Bounded(self, request: pb.TaintRequest, context) -> pb.TaintReply:  # noqa: N802
        raise BadRequest(f"node_id is {len(request.node_id)} characters")

    async def Broken(self, request: pb.TaintRequest, context) -> pb.TaintReply:  # noqa: N802
        return {}[request.node_id]  # KeyError, with no decorator to map it

    async def BrokenStream(self, request: pb.TaintRequest, context):  # noqa: N802
        yield pb.TaintReply()
        raise ZeroDivisionError("a bug")

    async def Echo(self, requests, context):  # noqa: N802
        async for request in requests:
            yield pb.TaintReply(taints=[pb.Taint(key=request.node_id)])


def handler(servicer: Faulty) -> grpc.GenericRpcHandler:
    unary = dict(
        request_deserializer=pb.TaintRequest.FromString,
        response_serializer=pb.TaintReply.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Bounded": grpc.unary_unary_rpc_method_handler(servicer.Bounded, **unary),
            "Broken": grpc.unary_unary_rpc_method_handler(servicer.Broken, **unary),
            "BrokenStream": grpc.unary_stream_rpc_method_handler(servicer.BrokenStream, **unary),
            "Echo": grpc.stream_stream_rpc_method_handler(servicer.Echo, **unary),
        },
    )


@pytest.fixture
async def served():
    registry = CollectorRegistry()
    clock = FakeClock()
    guard = RejectionGuard(registry, LogLimiter(clock=clock))
    server = grpc.aio.server(interceptors=[guard])
    server.add_generic_rpc_handlers([handler(Faulty())])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield channel, registry, clock
    await channel.close()
    await server.stop(None)


def raw(channel: grpc.aio.Channel, method: str, streaming: str = ""):
    same = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)
    make = {"": channel.unary_unary, "out": channel.unary_stream, "both": channel.stream_stream}
    return make[streaming](f"/{SERVICE}/{method}", **same)


def rejected(registry: CollectorRegistry, method: str, code: str) -> float:
    labels = {"service": SERVICE, "method": method, "code": code}
    return registry.get_sample_value("spotdrain_rpc_rejected_total", labels) or 0.0


def lines(caplog, level: int = logging.INFO) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= level and r.name.startswith("spotdrain")]


async def test_an_undecodable_body_is_invalid_argument_counted_and_logged_once(served, caplog):
    """Twenty undecodable bodies from one client: twenty INVALID_ARGUMENT (gRPC alone would
    answer UNKNOWN with a traceback each), twenty counted, one line; a minute later one more,
    saying how many were held back."""
    channel, registry, clock = served
    caplog.set_level(logging.DEBUG)
    for _ in range(20):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw(channel, "Bounded")(b"\xff\xff\xff")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "undecodable body of 3 bytes (DecodeError)" in err.value.details()
    assert rejected(registry, "Bounded", "INVALID_ARGUMENT") == 20
    [line] = [r for r in lines(caplog) if "rejected" in r.getMessage()]
    assert f"/{SERVICE}/Bounded" in line.getMessage() and "ipv4:127.0.0.1" in line.getMessage()
    assert line.exc_info is None
    clock.now += 61
    with pytest.raises(grpc.aio.AioRpcError):
        await raw(channel, "Bounded")(b"\xff")
    assert "(19 more from this peer" in lines(caplog)[-1].getMessage()
    assert "Traceback" not in caplog.text


async def test_a_field_out_of_bounds_is_counted_as_the_servicer_refused_it(served, caplog):
    channel, registry, _ = served
    caplog.set_level(logging.DEBUG)
    request = pb.TaintRequest(node_id="n" * 300).SerializeToString()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw(channel, "Bounded")(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert rejected(registry, "Bounded", "INVALID_ARGUMENT") == 1
    [line] = lines(caplog)
    assert "INVALID_ARGUMENT: node_id is 300 characters" in line.getMessage()


@pytest.mark.parametrize(
    "method, streaming, error",
    [
        ("Broken", "", "KeyError"),
        ("BrokenStream", "out", "ZeroDivisionError"),
    ],
)
async def test_an_exception_out_of_a_servicer_is_internal_in_one_line(
    served, caplog, method, streaming, error
):
    """A bug: INTERNAL (never UNKNOWN), counted, one line naming the exception at ERROR, the
    traceback at DEBUG only."""
    channel, registry, _ = served
    caplog.set_level(logging.DEBUG)
    call = raw(channel, method, streaming)(pb.TaintRequest(node_id="x").SerializeToString())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        if streaming:
            async for _ in call:
                pass
        else:
            await call
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details() == f"internal error ({error})"
    assert rejected(registry, method, "INTERNAL") == 1
    [line] = lines(caplog)
    assert line.levelno == logging.ERROR and error in line.getMessage()
    assert line.exc_info is None
    [debug] = [r for r in caplog.records if r.levelno == logging.DEBUG and r.exc_info]
    assert debug.exc_info[0].__name__ == error


async def test_an_undecodable_message_mid_stream_ends_that_stream_invalid_argument(served):
    """Good messages are answered; the first that does not decode ends the stream with
    INVALID_ARGUMENT, counted."""
    channel, registry, _ = served
    good = pb.TaintRequest(node_id="n1").SerializeToString()
    call = raw(channel, "Echo", "both")(iter([good, b"\xff\xff", good]))
    answers = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for answer in call:
            answers.append(pb.TaintReply.FromString(answer).taints[0].key)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert answers == ["n1"]
    assert rejected(registry, "Echo", "INVALID_ARGUMENT") == 1


async def test_an_unknown_method_is_still_unimplemented(served):
    channel, registry, _ = served
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw(channel, "Missing")(b"")
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


# --- every string and repeated field of a request, bounded before any servicer --------------


def test_a_string_too_long_anywhere_in_a_request_is_named():
    from spotdrain.coordinator.api.convert import check_request
    from spotdrain.coordinator.api.errors import TooLarge
    from spotdrain.protocol import limits

    long = "x" * (limits.MAX_STRING_CHARS + 1)
    check_request(pb.AgentMessage(register=pb.Register(node_id="n" * limits.MAX_STRING_CHARS)))
    with pytest.raises(BadRequest, match=r"register\.workers\[1\]\.reason is 4097 characters"):
        check_request(
            pb.AgentMessage(
                register=pb.Register(workers=[pb.WorkerReport(), pb.WorkerReport(reason=long)])
            )
        )
    with pytest.raises(BadRequest, match=r"reclamation\.steps key is 4097 characters"):
        check_request(pb.Timeline(reclamation=pb.Reclamation(steps={long: 1.0})))
    with pytest.raises(TooLarge, match=f"at most {limits.MAX_REPEATED}"):
        check_request(pb.EventAck(uids=[""] * (limits.MAX_REPEATED + 1)))
    # An event's details have their own bounds (size, depth, numbers: convert.batch_events).
    check_request(pb.EventBatch(events=[pb.Event(details_json=long)]))


async def test_a_request_out_of_bounds_never_reaches_the_servicer(served):
    """A 5,000-character reason: INVALID_ARGUMENT from the guard, naming the field, and the
    servicer (which would say something else) never runs."""
    channel, registry, _ = served
    request = pb.TaintRequest(node_id="n1", reason="r" * 5000).SerializeToString()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await raw(channel, "Broken")(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "reason is 5000 characters, at most 4096"
    assert rejected(registry, "Broken", "INVALID_ARGUMENT") == 1


async def test_a_status_message_quoting_the_caller_is_bounded(caplog):
    """A refusal that quotes a 4,000-character id stays within a client's metadata limit."""
    from spotdrain.coordinator.api.errors import NotFound, end_with
    from spotdrain.protocol import limits

    class Context:
        def set_code(self, code):
            self.code = code

        def set_details(self, details):
            self.details = details

        def peer(self):
            return "ipv4:127.0.0.1:1"

    context = Context()
    end_with(context, NotFound(f"no rental {'é' * 4000!r}"), "GetRental")
    assert context.code == grpc.StatusCode.NOT_FOUND
    assert len(context.details) == limits.MAX_STATUS_CHARS
    assert context.details.startswith("no rental 'ééé") and context.details.endswith("...")


async def test_a_refused_call_is_freed_without_the_cycle_collector(served):
    """Refused calls of every kind (a domain error, a body that does not decode, a bug out of
    a stream) leave no reference cycle: their request and the handler's frames are freed by
    reference counting. The coordinator runs full collections only when memory has grown
    (coordinator/gc_pauses.py): an abort's exception, kept on the call's state with the handler
    frames in its
    traceback, made a cycle of each refusal, and the fuzz test saw +100 MiB of them."""
    channel, _, _ = served
    request = pb.TaintRequest(node_id="n" * 300).SerializeToString()

    async def refusals() -> None:
        for _ in range(20):
            for body in (request, b"\xff\xff"):
                with pytest.raises(grpc.aio.AioRpcError):
                    await raw(channel, "Bounded")(body)
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in raw(channel, "BrokenStream", "out")(request):
                    pass

    await refusals()  # the channel's and the server's own first-call objects
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds is kept in gc.garbage, to look at
    try:
        await refusals()
        gc.collect()
        garbage = collections.Counter(type(o).__name__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    # (gRPC's own method lookup behind an interceptor makes a small cycle of every call, five
    # objects that hold no request; what a refusal made is not among them.)
    kept = {
        name: n
        for name, n in garbage.items()
        if name in ("frame", "traceback", "coroutine", "TaintRequest", "RPCState")
        or name.endswith(("Error", "Exception", "Request"))
    }
    assert not kept, f"in cycles after 60 refused calls: {kept}"
