"""Emulators of the three clouds' instance metadata services, for the notice sources' tests and
for benchmarks: AWS IMDSv2 (`AwsImds`), the GCE metadata server (`GceMetadata`) and Azure IMDS
with Scheduled Events (`AzureMetadata`).

Each is an aiohttp app on 127.0.0.1 (port 0 unless told) served from its own thread and event
loop, so sync tests, async tests and benchmark processes can all talk to it without the server
blocking their loop. Every emulator is a context manager, has `.url`, `.close()`, thread-safe
setters, `refuse()` / `accept()` (close the listening socket and reopen it on the same port),
`fail_next(n, status)`, `malformed_next(n)`, `split_next(n)` and `trickle_next(n)` for the next
n requests, a request log (`.seen`)
and `changed_at`, the time.monotonic() at which the last state change became visible to clients.

What each emulator answers follows the providers' documentation:
- AWS: https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html
  (token PUT, TTL 1..21600 s, 401 for a missing/invalid/expired token when v2 is required),
  .../instancedata-data-retrieval.html (400 bad PUT, 401 bad token, 403 not allowed, 404 absent,
  text/plain; PUT on a versioned path is 403), .../spot-instance-termination-notices.html
  (instance-action JSON or 404), .../rebalance-recommendations.html ({"noticeTime": ...} or
  404), .../monitoring-instances-status-check_sched.html (events/maintenance/scheduled list),
  .../instancedata-data-categories.html (instance-id, placement/region,
  placement/availability-zone, instance-type, instance-life-cycle `spot` or `on-demand`).
- GCE: https://cloud.google.com/compute/docs/metadata/querying-metadata (Metadata-Flavor: Google
  required, 403 otherwise, echoed on answers; ETag; wait_for_change, last_etag, timeout_sec),
  https://cloud.google.com/compute/docs/troubleshooting/troubleshoot-metadata-server (codes;
  the official hanging-GET sample retries 503 "during maintenance"; instance/id, instance/zone
  and instance/machine-type as `projects/NUMBER/zones/ZONE` and `projects/NUMBER/machineTypes/
  TYPE`, instance/scheduling/preemptible `TRUE`/`FALSE`, and provisioning-model where given).
  `impostor()` answers as something else on the metadata address would (a proxy, a captive
  portal): no Metadata-Flavor.
- Azure: https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events (document shape,
  Metadata: true else 400, POST StartRequests, 200 for a valid id, 400 for a malformed request,
  incarnation moves when Events change, an approved event goes to Started),
  https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service (api-version
  mandatory, duplicate query names rejected, X-Forwarded-For rejected, GET only, format=text
  needed on a leaf node; the compute document's vmId, location, zone, vmSize, priority).
  NotBefore is written as the docs write it (RFC 1123) or, with `date_style="iso"`, as
  Microsoft's own scheduled-events mock server does ("2026-12-02T18:13:35Z");
  `unreadable_event()` is an event for this VM nobody can read, for documents that mix one
  with good events.

Run one alone for a benchmark process: `python tests/fakes/cloudmeta.py aws|gcp|azure --port N`;
with `--control` it takes calls of its setters on stdin, one JSON line each, and answers each
with the wall-clock time at which the change became visible (`control()`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import email.utils
import hashlib
import json
import secrets
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy, MultiDict, MultiDictProxy

# --- time formats the providers use ------------------------------------------------------------


def iso_utc(ts: float | None = None) -> str:
    """AWS spot/rebalance time: "2017-09-18T08:22:00Z"."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if ts is None else ts))


def aws_date(ts: float | None = None) -> str:
    """AWS scheduled-maintenance date: "21 Jan 2019 09:00:43 GMT"."""
    return time.strftime("%d %b %Y %H:%M:%S GMT", time.gmtime(time.time() if ts is None else ts))


def rfc1123(ts: float | None = None) -> str:
    """Azure NotBefore: "Mon, 19 Sep 2016 18:29:47 GMT"."""
    return email.utils.formatdate(time.time() if ts is None else ts, usegmt=True)


def dotnet_round_trip(ts: float | None = None) -> str:
    """.NET's round-trip ("o") form: "2026-12-02T18:13:35.1234567+00:00"."""
    ts = time.time() if ts is None else ts
    ticks = round((ts % 1) * 10**7) % 10**7
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(int(ts))) + f".{ticks:07d}+00:00"


# Azure NotBefore forms: the docs', Microsoft's mock server's, and .NET's round trip.
AZURE_DATE_STYLES: dict[str, Callable[[float | None], str]] = {
    "rfc1123": rfc1123,
    "iso": iso_utc,
    "iso-fraction": dotnet_round_trip,
}


class ManualClock:
    """An injectable clock (AwsImds token TTLs) that moves only when told; thread-safe."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


@dataclass
class Seen:
    """One request as received: `at` is time.monotonic() on arrival, `status` what it was
    answered (None while it is still being answered, e.g. a hanging GET, or if its connection
    was dropped first, as by refuse())."""

    method: str
    path: str
    query: MultiDictProxy[str]
    headers: CIMultiDictProxy[str]
    body: bytes
    at: float
    status: int | None = None


def _text(
    body: str | bytes,
    status: int = 200,
    content_type: str = "text/plain",
    headers: dict[str, str] | None = None,
) -> web.Response:
    data = body.encode() if isinstance(body, str) else body
    return web.Response(status=status, body=data, content_type=content_type, headers=headers)


def _json(value: Any, status: int = 200, content_type: str = "application/json") -> web.Response:
    return _text(json.dumps(value), status, content_type)


class _Emulator:
    """The shared machinery: thread and loop, listening socket, log, injected faults."""

    kind = "?"

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = 0
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._log: list[Seen] = []
        self._failures: collections.deque[tuple[int, bytes, str | None]] = collections.deque()
        self._malformed: collections.deque[str | None] = collections.deque()
        self._paced: collections.deque[tuple[str | None, str, float]] = collections.deque()
        self.changes: list[tuple[str, float]] = []
        self._closing = False
        self._listening = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"cloudmeta-{self.kind}", daemon=True
        )
        self._thread.start()
        try:
            self._call(self._setup(port))
        except BaseException:
            self._stop_loop()
            raise

    # -- lifecycle --

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Answer any hanging request, stop serving and end the thread; idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._call(self._teardown())
        self._stop_loop()

    def refuse(self) -> None:
        """Close the listening socket and drop open connections: connects are refused until
        accept(). Requests in flight (a hanging GET included) see their connection reset."""
        self._call(self._refuse())

    def accept(self) -> None:
        """Listen again, on the same port."""
        self._call(self._listen(self.port))

    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    async def _setup(self, port: int) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._wake = asyncio.Event()
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        await self._listen(port)

    async def _listen(self, port: int) -> None:
        if self._listening:
            return
        self._site = web.TCPSite(self._runner, self.host, port, reuse_address=True)
        await self._site.start()
        self.port = self._site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._listening = True

    async def _refuse(self) -> None:
        if self._listening:
            await self._site.stop()
            self._listening = False
        self._drop_connections()

    def _drop_connections(self) -> None:
        server = self._runner.server
        for handler in server.connections if server is not None else ():
            if handler.transport is not None:
                handler.transport.abort()

    async def _teardown(self) -> None:
        # Hanging GETs see _closing and answer; cleanup() then waits (up to its shutdown
        # timeout) for every handler to finish before it closes the connections.
        self._notify()
        await self._runner.cleanup()
        self._listening = False

    # -- state changes --

    def _changed(self, what: str) -> None:
        """Call under self._lock once the new state is in place: clients see it from now on."""
        self.changes.append((what, time.monotonic()))
        if not self._closing:
            self._loop.call_soon_threadsafe(self._notify)

    def _notify(self) -> None:
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    @property
    def changed_at(self) -> float | None:
        """time.monotonic() when the latest state change became visible; None before any."""
        with self._lock:
            return self.changes[-1][1] if self.changes else None

    # -- faults --

    def fail_next(
        self, n: int = 1, status: int = 503, body: bytes = b"", path: str | None = None
    ) -> None:
        """Answer the next n requests (those whose path starts with `path`, if given) with
        `status` instead of their real answer."""
        with self._lock:
            self._failures.extend([(status, body, path)] * n)

    def malformed_next(self, n: int = 1, path: str | None = None) -> None:
        """Cut and corrupt the body of the next n answers that would have been 200s."""
        with self._lock:
            self._malformed.extend([path] * n)

    def split_next(
        self, n: int = 1, path: str | None = None, gap_s: float = 0.15, chunked: bool = False
    ) -> None:
        """Send the next n answers in two pieces `gap_s` apart, as a link that splits a
        response does: with their Content-Length, or `chunked` (one chunk a piece)."""
        with self._lock:
            self._paced.extend([(path, "chunked" if chunked else "split", gap_s)] * n)

    def trickle_next(self, n: int = 1, path: str | None = None, every_s: float = 0.25) -> None:
        """Send the next n answers a byte every `every_s`, with their Content-Length."""
        with self._lock:
            self._paced.extend([(path, "trickle", every_s)] * n)

    @staticmethod
    def _take(queue: collections.deque, path: str, key: Callable[[Any], str | None]):
        """The first queued fault meant for `path`, removed: (True, fault), else (False, None)."""
        for index, item in enumerate(queue):
            prefix = key(item)
            if prefix is None or path.startswith(prefix):
                del queue[index]
                return True, item
        return False, None

    # -- the log --

    @property
    def seen(self) -> list[Seen]:
        with self._lock:
            return list(self._log)

    def clear_seen(self) -> None:
        with self._lock:
            self._log.clear()

    def wait_seen(
        self, match: Callable[[Seen], bool] = lambda s: True, count: int = 1, timeout: float = 5.0
    ) -> list[Seen]:
        """Block until `count` logged requests satisfy `match`; returns them. TimeoutError
        otherwise. From an async test use `await emu.await_seen(...)` instead."""
        with self._cond:
            if not self._cond.wait_for(lambda: sum(map(match, self._log)) >= count, timeout):
                raise TimeoutError(f"{self.kind}: fewer than {count} matching requests")
            return [s for s in self._log if match(s)]

    async def await_seen(
        self, match: Callable[[Seen], bool] = lambda s: True, count: int = 1, timeout: float = 5.0
    ) -> list[Seen]:
        return await asyncio.to_thread(self.wait_seen, match, count, timeout)

    # -- request handling --

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        seen = Seen(
            request.method,
            request.path,
            MultiDictProxy(MultiDict(request.query)),
            CIMultiDictProxy(CIMultiDict(request.headers)),
            body,
            time.monotonic(),
        )
        with self._cond:
            self._log.append(seen)
            self._cond.notify_all()
            failed, failure = self._take(self._failures, request.path, lambda f: f[2])
        if failed:
            response = _text(failure[1], failure[0])
        else:
            response = await self._handle(request, seen)
            if response.status == 200:
                with self._lock:
                    cut, _ = self._take(self._malformed, request.path, lambda p: p)
                if cut:
                    good = response.body if isinstance(response.body, bytes) else b""
                    response = _text(
                        good[: len(good) // 2] + b"\xff{",
                        content_type=response.content_type,
                        headers={
                            k: v
                            for k, v in response.headers.items()
                            if k.lower() not in ("content-length", "content-type")
                        },
                    )
        self._decorate(response)
        with self._cond:
            seen.status = response.status
            self._cond.notify_all()
            paced, pace = self._take(self._paced, request.path, lambda p: p[0])
        if paced:
            return await self._send_paced(request, response, pace[1], pace[2])
        return response

    @staticmethod
    async def _send_paced(
        request: web.Request, response: web.Response, how: str, gap_s: float
    ) -> web.StreamResponse:
        body = response.body if isinstance(response.body, bytes) else b""
        stream = web.StreamResponse(
            status=response.status,
            headers={
                k: v
                for k, v in response.headers.items()
                if k.lower() not in ("content-length", "transfer-encoding")
            },
        )
        if how == "chunked":
            stream.enable_chunked_encoding()
        else:
            stream.content_length = len(body)
        half = len(body) // 2
        pieces = (
            [body[i : i + 1] for i in range(len(body))]
            if how == "trickle"
            else [body[:half], body[half:]]
        )
        try:
            await stream.prepare(request)
            for index, piece in enumerate(pieces):
                if index:
                    await asyncio.sleep(gap_s)
                await stream.write(piece)
            await stream.write_eof()
        except ConnectionError:
            pass  # the client gave up mid-answer (its deadline): nothing more to send
        return stream

    def _decorate(self, response: web.Response) -> None:
        pass

    async def _handle(self, request: web.Request, seen: Seen) -> web.Response:
        raise NotImplementedError


# --- AWS IMDSv2 ---------------------------------------------------------------------------------

TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
SPOT_ACTIONS = ("hibernate", "stop", "terminate")


def aws_maintenance_event(
    code: str = "system-reboot",
    *,
    event_id: str | None = None,
    not_before: float | None = None,
    not_after: float | None = None,
    state: str = "active",
    description: str = "scheduled reboot",
) -> dict:
    """One element of events/maintenance/scheduled, shaped as AWS documents it."""
    start = time.time() + 3600 if not_before is None else not_before
    return {
        "NotBefore": aws_date(start),
        "Code": code,
        "Description": description,
        "EventId": event_id or f"instance-event-{secrets.token_hex(9)[:17]}",
        "NotAfter": aws_date(start + 1000 if not_after is None else not_after),
        "State": state,
    }


class AwsImds(_Emulator):
    """IMDSv2 on an instance that requires tokens (HttpTokens=required): IMDSv1 GETs get 401."""

    kind = "aws"

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        instance_id: str = "i-0123456789abcdef0",
        region: str = "us-east-1",
        zone: str = "us-east-1a",
        instance_type: str = "g5.xlarge",
        life_cycle: str = "spot",
        require_v2: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.clock = clock
        self.wall = wall  # what a re-stamped time is written from, read once per answer
        self.instance_id = instance_id
        self.identity = {
            "instance-id": instance_id,
            "placement/region": region,
            "placement/availability-zone": zone,
            "instance-type": instance_type,
            "instance-life-cycle": life_cycle,
        }
        self.require_v2 = require_v2
        self._tokens: dict[str, float] = {}
        self._token_failures: collections.deque[int] = collections.deque()
        self._instance_action: dict | None = None
        self._rebalance: dict | None = None
        # Re-stamped on every read, as amazon-ec2-metadata-mock does by default: the
        # instance-action's time is `wall() + this`, the rebalance's noticeTime `wall()`.
        self._action_in_s: float | None = None
        self._restamp_rebalance = False
        self._maintenance: list[dict] = []
        super().__init__(host=host, port=port)

    # setters

    def set_instance_action(
        self,
        action: str = "terminate",
        time_iso: str | None = None,
        *,
        restamp_in_s: float | None = None,
    ) -> None:
        """`restamp_in_s`: every read names time = now + this (AWS's mock, by default)."""
        if action not in SPOT_ACTIONS:
            raise ValueError(f"instance-action is one of {SPOT_ACTIONS}, not {action!r}")
        with self._lock:
            self._instance_action = {
                "action": action,
                "time": time_iso or iso_utc(time.time() + 120),
            }
            self._action_in_s = restamp_in_s
            self._changed("instance-action")

    def clear_instance_action(self) -> None:
        with self._lock:
            self._instance_action = None
            self._changed("instance-action")

    def set_rebalance(self, notice_time_iso: str | None = None, *, restamp: bool = False) -> None:
        """`restamp`: every read names noticeTime = now (AWS's mock, by default)."""
        with self._lock:
            self._rebalance = {"noticeTime": notice_time_iso or iso_utc()}
            self._restamp_rebalance = restamp
            self._changed("rebalance")

    def clear_rebalance(self) -> None:
        with self._lock:
            self._rebalance = None
            self._changed("rebalance")

    def resume(self) -> None:
        """The instance started again after a hibernation, with the same instance id (and boot
        id): what was pending for the interruption it hibernated for is no longer shown."""
        with self._lock:
            self._instance_action = None
            self._rebalance = None
            self._changed("resumed")

    def set_maintenance(self, events: list[dict]) -> None:
        """events/maintenance/scheduled: [] for none, else dicts such as aws_maintenance_event()."""
        with self._lock:
            self._maintenance = [dict(e) for e in events]
            self._changed("maintenance")

    def expire_tokens(self) -> None:
        """Every token issued so far is now invalid (as after their TTL)."""
        with self._lock:
            self._tokens.clear()

    def fail_token_put(self, n: int = 1, status: int = 403) -> None:
        """The next n token PUTs fail: 403 is AWS's "not allowed or the service is turned off";
        503 and 429-style throttling are what a busy IMDS answers (use any status)."""
        with self._lock:
            self._token_failures.extend([status] * n)

    @property
    def tokens(self) -> int:
        """How many tokens are valid now."""
        with self._lock:
            now = self.clock()
            return sum(1 for expiry in self._tokens.values() if expiry > now)

    # serving

    async def _handle(self, request: web.Request, seen: Seen) -> web.Response:
        if request.method == "PUT":
            return self._put_token(request)
        if request.method not in ("GET", "HEAD"):
            return _text("", 405)
        token = request.headers.get(TOKEN_HEADER)
        with self._lock:
            if token is not None:
                expiry = self._tokens.get(token)
                if expiry is None or expiry <= self.clock():
                    return _text("", 401)
            elif self.require_v2:
                return _text("", 401)
            return self._get(request.path)

    def _put_token(self, request: web.Request) -> web.Response:
        if request.path != TOKEN_PATH or "X-Forwarded-For" in request.headers:
            return _text("", 403)
        with self._lock:
            if self._token_failures:
                return _text("", self._token_failures.popleft())
            raw = request.headers.get(TTL_HEADER, "")
            if not raw.isdigit() or not 1 <= int(raw) <= 21600:
                return _text("", 400)
            token = secrets.token_urlsafe(42)
            self._tokens[token] = self.clock() + int(raw)
        return _text(token, headers={TTL_HEADER: raw})

    def _get(self, path: str) -> web.Response:
        prefix = "/latest/meta-data/"
        item = path[len(prefix) :] if path.startswith(prefix) else None
        if item == "spot/instance-action" and self._instance_action:
            if self._action_in_s is not None:
                self._instance_action["time"] = iso_utc(self.wall() + self._action_in_s)
            return _text(json.dumps(self._instance_action))
        if (
            item == "spot/termination-time"
            and self._instance_action
            and self._instance_action["action"] == "terminate"
        ):
            return _text(self._instance_action["time"])
        if item == "events/recommendations/rebalance" and self._rebalance:
            if self._restamp_rebalance:
                self._rebalance["noticeTime"] = iso_utc(self.wall())
            return _text(json.dumps(self._rebalance))
        if item == "events/maintenance/scheduled":
            return _text(json.dumps(self._maintenance))
        if item in self.identity:
            return _text(self.identity[item])
        return _text("", 404)


# --- GCE metadata server -----------------------------------------------------------------------

GCE_PREFIX = "/computeMetadata/v1/instance/"
MAINTENANCE_EVENTS = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")


class GceMetadata(_Emulator):
    """The GCE metadata server's instance/ values with hanging GETs (wait_for_change)."""

    kind = "gcp"

    def __init__(
        self,
        *,
        instance_id: str = "4520031799277581759",
        name: str = "gpu-node-0",
        zone: str = "us-central1-a",
        machine_type: str = "g2-standard-4",
        preemptible: bool = True,
        provisioning_model: str | None = "SPOT",
        project_number: str = "123456789012",
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        """`provisioning_model`: None for a server that has no such key (404)."""
        self._values = {
            "preempted": "FALSE",
            "maintenance-event": "NONE",
            "id": instance_id,
            "name": name,
            "zone": f"projects/{project_number}/zones/{zone}",
            "machine-type": f"projects/{project_number}/machineTypes/{machine_type}",
            "scheduling/preemptible": "TRUE" if preemptible else "FALSE",
        }
        if provisioning_model is not None:
            self._values["scheduling/provisioning-model"] = provisioning_model
        self._released = 0
        self._hanging = 0
        self._impostor = False
        super().__init__(host=host, port=port)

    def impostor(self, on: bool = True) -> None:
        """Answer as something other than the metadata server would on its address (a proxy,
        a captive portal, another service): the request's Metadata-Flavor is neither required
        nor echoed, so no answer carries `Metadata-Flavor: Google`."""
        with self._lock:
            self._impostor = on

    def set_preempted(self, preempted: bool) -> None:
        self._set("preempted", "TRUE" if preempted else "FALSE")

    def set_maintenance_event(self, event: str) -> None:
        if event not in MAINTENANCE_EVENTS:
            raise ValueError(f"maintenance-event is one of {MAINTENANCE_EVENTS}, not {event!r}")
        self._set("maintenance-event", event)

    def _set(self, key: str, value: str) -> None:
        with self._lock:
            if self._values[key] != value:
                self._values[key] = value
                self._changed(key)

    def value(self, key: str) -> str:
        with self._lock:
            return self._values[key]

    def etag(self, key: str) -> str:
        """The ETag the server sends for instance/<key> now (a hash of its content)."""
        with self._lock:
            return self._etag(key, self._values[key])

    @staticmethod
    def _etag(key: str, value: str) -> str:
        return hashlib.sha256(f"{key}\0{value}".encode()).hexdigest()[:16]

    def end_hanging_early(self) -> int:
        """Answer every hanging GET now with its unchanged value and ETag, as the real server
        does when its own timeout ends a hang. Returns how many were hanging."""
        with self._lock:
            self._released += 1
            count = self._hanging
            self._loop.call_soon_threadsafe(self._notify)
        return count

    @property
    def hanging(self) -> int:
        with self._lock:
            return self._hanging

    def wait_hanging(self, count: int = 1, timeout: float = 5.0) -> None:
        """Block until at least `count` GETs are hanging (a client is parked on a change)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._hanging >= count, timeout):
                raise TimeoutError(f"gcp: fewer than {count} hanging GETs")

    async def await_hanging(self, count: int = 1, timeout: float = 5.0) -> None:
        await asyncio.to_thread(self.wait_hanging, count, timeout)

    def _decorate(self, response: web.Response) -> None:
        with self._lock:
            if self._impostor:
                return
        response.headers["Metadata-Flavor"] = "Google"

    async def _handle(self, request: web.Request, seen: Seen) -> web.Response:
        with self._lock:
            impostor = self._impostor
        if not impostor and request.headers.get("Metadata-Flavor") != "Google":
            return _text("Missing required header: Metadata-Flavor", 403, "text/html")
        if request.method != "GET":
            return _text("", 405)
        key = request.path[len(GCE_PREFIX) :] if request.path.startswith(GCE_PREFIX) else None
        with self._lock:
            if key not in self._values:
                return _text("", 404, "text/html")
            value = self._values[key]
        if request.query.get("wait_for_change", "").lower() == "true":
            raw = request.query.get("timeout_sec")
            if raw is not None and (not raw.isdigit() or int(raw) < 1):
                return _text("timeout_sec must be a positive integer", 400, "text/html")
            last = request.query.get("last_etag") or self._etag(key, value)
            value = await self._hang(key, last, int(raw) if raw else None)
        return _text(
            value, content_type="application/text", headers={"ETag": self._etag(key, value)}
        )

    async def _hang(self, key: str, last_etag: str, timeout: float | None) -> str:
        deadline = None if timeout is None else self._loop.time() + timeout
        with self._cond:
            released = self._released
            self._hanging += 1
            self._cond.notify_all()
        try:
            while True:
                with self._lock:
                    value = self._values[key]
                    done = (
                        self._etag(key, value) != last_etag
                        or self._released != released
                        or self._closing
                    )
                if done:
                    return value
                remaining = None if deadline is None else deadline - self._loop.time()
                if remaining is not None and remaining <= 0:
                    return value
                try:
                    await asyncio.wait_for(self._wake.wait(), remaining)
                except TimeoutError:
                    pass
        finally:
            with self._cond:
                self._hanging -= 1
                self._cond.notify_all()


# --- Azure IMDS and Scheduled Events -------------------------------------------------------------

SCHEDULED_EVENTS_VERSIONS = (
    "2017-03-01",
    "2017-08-01",
    "2017-11-01",
    "2019-01-01",
    "2019-04-01",
    "2019-08-01",
    "2020-07-01",
)
INSTANCE_VERSIONS = (
    "2017-04-02",
    "2017-08-01",
    "2018-10-01",
    "2019-06-01",
    "2020-09-01",
    "2021-02-01",
    "2021-12-13",
    "2023-07-01",
    "2024-07-17",
    "2025-04-07",
)
EVENT_TYPES = ("Freeze", "Reboot", "Redeploy", "Preempt", "Terminate")


def azure_event(
    event_id: str | None = None,
    *,
    event_type: str = "Preempt",
    resources: tuple[str, ...] | list[str] = ("gpu-node-0",),
    status: str = "Scheduled",
    not_before: float | str | None = None,
    description: str = "",
    source: str = "Platform",
    duration: int = -1,
    date_style: str = "rfc1123",
) -> dict:
    """One Scheduled Events entry with every field of api-version 2020-07-01. `not_before` as
    a UNIX time or an already formatted string; the default is the documented minimum notice
    for a Preempt (30 s) from now. `date_style`: one of AZURE_DATE_STYLES."""
    if event_type not in EVENT_TYPES:
        raise ValueError(f"EventType is one of {EVENT_TYPES}, not {event_type!r}")
    when = (
        not_before
        if isinstance(not_before, str)
        else AZURE_DATE_STYLES[date_style](time.time() + 30 if not_before is None else not_before)
    )
    return {
        "EventId": event_id or str(uuid.uuid4()).upper(),
        "EventType": event_type,
        "ResourceType": "VirtualMachine",
        "Resources": list(resources),
        "EventStatus": status,
        "NotBefore": when,
        "Description": description,
        "EventSource": source,
        "DurationInSeconds": duration,
    }


def unreadable_event(
    event_id: str | None = None,
    *,
    event_type: str = "Terminate",
    resources: tuple[str, ...] | list[str] = ("gpu-node-0",),
    not_before: str = "sometime next week",
) -> dict:
    """An event for the VM whose NotBefore no reader can take as a date (a mixed document puts
    it beside good ones)."""
    return azure_event(event_id, event_type=event_type, resources=resources, not_before=not_before)


class AzureMetadata(_Emulator):
    """Azure IMDS: /metadata/scheduledevents (GET and the StartRequests POST) and
    /metadata/instance/compute[/name] so a client can tell this VM's events from others'.

    `on_start`: what approving an event (POST) does: "start" (documented: the next document has
    it EventStatus "Started", NotBefore "", and a new incarnation), "remove" (as when it
    completes at once) or "keep" (nothing visible changes)."""

    kind = "azure"

    def __init__(
        self,
        *,
        vm_name: str = "gpu-node-0",
        on_start: str = "start",
        vm_id: str = "02aab8a4-74ef-476e-8182-f6d2ba4166a6",
        location: str = "westeurope",
        zone: str = "1",
        vm_size: str = "Standard_NC6s_v3",
        priority: str = "Spot",
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        if on_start not in ("start", "remove", "keep"):
            raise ValueError(f"on_start: start, remove or keep, not {on_start!r}")
        self.vm_name = vm_name
        self.identity = {
            "vmId": vm_id,
            "location": location,
            "zone": zone,
            "vmSize": vm_size,
            "priority": priority,
        }
        self.on_start = on_start
        self.incarnation = 1
        self._events: list[dict] = []
        self.acknowledged: list[str] = []
        super().__init__(host=host, port=port)

    def set_events(self, events: list[dict]) -> None:
        """Replace the Events list; DocumentIncarnation moves only when it differs."""
        with self._lock:
            new = [dict(e) for e in events]
            if new != self._events:
                self._events = new
                self.incarnation += 1
                self._changed("events")

    def bump_incarnation(self) -> None:
        """A new document with the same events, as when an event for a VM that shares this
        one's set changes in a way this VM's list does not show."""
        with self._lock:
            self.incarnation += 1
            self._changed("incarnation")

    def set_vm_name(self, name: str) -> None:
        with self._lock:
            self.vm_name = name
            self._changed("vm-name")

    def document(self) -> dict:
        with self._lock:
            return {
                "DocumentIncarnation": self.incarnation,
                "Events": [dict(e) for e in self._events],
            }

    async def _handle(self, request: web.Request, seen: Seen) -> web.Response:
        if request.headers.get("Metadata", "").lower() != "true" or (
            "X-Forwarded-For" in request.headers
        ):
            return _json({"error": "Bad request. Required metadata header not specified"}, 400)
        if any(len(request.query.getall(k)) > 1 for k in request.query):
            return _json({"error": "Bad request. Query parameters are duplicated"}, 400)
        if request.path in ("/metadata/scheduledevents", "/metadata/scheduledevents/"):
            versions = SCHEDULED_EVENTS_VERSIONS
        elif request.path.startswith("/metadata/instance"):
            versions = INSTANCE_VERSIONS
        else:
            return _json({"error": "Not found"}, 404)
        if request.query.get("api-version") not in versions:
            return _json(
                {
                    "error": "Bad request. api-version is invalid or was not specified in "
                    "the request. For more information refer to aka.ms/azureimds",
                    "newest-versions": list(reversed(versions))[:3],
                },
                400,
            )
        if versions is INSTANCE_VERSIONS:
            return self._instance(request)
        if request.method == "GET":
            return _json(self.document())
        if request.method == "POST":
            return self._start_requests(seen.body)
        return _json({"error": "Method not allowed"}, 405)

    def _instance(self, request: web.Request) -> web.Response:
        if request.method != "GET":
            return _json({"error": "Method not allowed"}, 405)
        with self._lock:
            compute = {
                "name": self.vm_name,
                **self.identity,
                "evictionPolicy": "Delete" if self.identity["priority"] == "Spot" else "",
                "osType": "Linux",
            }
        tail = request.path[len("/metadata/instance") :].strip("/")
        fmt = request.query.get("format", "json")
        if tail in ("", "compute"):
            return _json(compute if tail else {"compute": compute})
        if tail.startswith("compute/") and tail[len("compute/") :] in compute:
            if fmt != "text":  # a leaf node answers only format=text
                return _json({"error": "Bad request. Leaf nodes require format=text"}, 400)
            return _text(compute[tail[len("compute/") :]])
        return _json({"error": "Not found"}, 404)

    def _start_requests(self, body: bytes) -> web.Response:
        try:
            requests = json.loads(body)["StartRequests"]
            ids = [r["EventId"] for r in requests]
            assert isinstance(requests, list) and all(isinstance(i, str) for i in ids)
        except (ValueError, KeyError, TypeError, AssertionError):
            return _json({"error": "Bad request. Invalid StartRequests payload"}, 400)
        with self._lock:
            known = {e["EventId"] for e in self._events}
            if not ids or any(i not in known for i in ids):
                return _json({"error": "Bad request. Unknown EventId"}, 400)
            self.acknowledged.extend(ids)
            if self.on_start == "remove":
                self._events = [e for e in self._events if e["EventId"] not in ids]
            elif self.on_start == "start":
                for e in self._events:
                    if e["EventId"] in ids:
                        e["EventStatus"], e["NotBefore"] = "Started", ""
            if self.on_start != "keep":
                self.incarnation += 1
                self._changed("start-requests")
        return _text("", 200)


EMULATORS: dict[str, type[_Emulator]] = {"aws": AwsImds, "gcp": GceMetadata, "azure": AzureMetadata}


def control(emulator: _Emulator, lines, out) -> None:
    """Serve one call a line until end of input: {"call": NAME, "args": [...], "kwargs": {...}}
    names a public method (or property) of the emulator; the answer is one JSON line,
    {"result": ..., "changed_wall": W} with W the time.time() at which the latest state change
    became visible (changed_at on this process's wall clock; null before any), or {"error": ...}.
    """
    for line in lines:
        try:
            request = json.loads(line)
            name = request["call"]
            if not isinstance(name, str) or name.startswith("_"):
                raise AttributeError(f"no public member {name!r}")
            member = getattr(emulator, name)
            result = (
                member(*request.get("args", ()), **request.get("kwargs", {}))
                if callable(member)
                else member
            )
            changed = emulator.changed_at
            wall = None if changed is None else time.time() - (time.monotonic() - changed)
            answer = {"result": _plain(result), "changed_wall": wall}
        except Exception as e:  # the caller's mistake, answered, not fatal
            answer = {"error": f"{e.__class__.__name__}: {e}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def _plain(value: Any) -> Any:
    if isinstance(value, Seen):
        return {"method": value.method, "path": value.path, "status": value.status, "at": value.at}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve one cloud metadata emulator until killed.")
    parser.add_argument("cloud", choices=sorted(EMULATORS))
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--control",
        action="store_true",
        help="take calls on stdin, one JSON line each, answered on stdout; end of input stops it",
    )
    args = parser.parse_args(argv)
    stop = threading.Event()

    def stopped(*_: object) -> None:
        stop.set()
        if args.control:
            raise SystemExit(0)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stopped)
    with EMULATORS[args.cloud](host=args.host, port=args.port) as emulator:
        print(emulator.url, flush=True)
        if args.control:
            control(emulator, sys.stdin, sys.stdout)
        else:
            stop.wait()


if __name__ == "__main__":
    main()
