"""Replacement capacity from another node group (docs/design.md hard notice step 6).

On a hard notice the coordinator asks an acquirer, configured per node group, for capacity in a
group other than the reclaimed one. Nothing on the reclaimed node waits for the answer, so an
acquirer never raises: a failure, a timeout or a bad answer comes back as `ok=False` with the
reason, a fact to record in the `replacement_requested` event. Only cancellation propagates.

Two implementations:

- `ExecAcquirer`: runs a command (no shell) in its own process group, the request as JSON on
  stdin; exit 0 is ok. Stdout may carry a JSON object, kept as `response`; anything else on stdout
  is ignored (and said so in `detail`). At the timeout, or if the caller cancels, the whole
  process group is killed, so a helper the command spawned does not outlive it.
- `WebhookAcquirer`: HTTP POST of the same JSON (aiohttp); a 2xx status is ok. The request id is
  sent as `Idempotency-Key`, so a receiver can drop a repeat.

Configuration (a TOML table, as a dict), per node group:

    avoid_s = 300                      # optional: the avoidance window, seconds
    [groups.gpu-b]
    exec = ["/usr/local/bin/buy-capacity", "--group", "gpu-b"]
    timeout_s = 10                     # optional, default 10
    [groups.gpu-c]
    webhook = "https://capacity.example/acquire"
    timeout_s = 5
    headers = { Authorization = "Bearer ..." }   # webhook only

Also pure helpers for where to ask: `AvoidanceWindow` (a reclaimed group gets no new placements
and no acquisitions for `avoid_s`, default 300 s) and `choose_target_group`.
"""

from __future__ import annotations

import abc
import asyncio
import json
import math
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import aiohttp

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_AVOID_S = 300.0
_DETAIL_MAX = 300  # characters of a command's stderr or a server's body kept in `detail`


@dataclass(frozen=True)
class AcquisitionRequest:
    request_id: str
    reclaimed_node: str
    reclaimed_group: str
    target_group: str
    gpus: int  # GPUs lost with the reclaimed node
    models: tuple[str, ...]  # models whose workers ran there
    reason: str  # "notice" | "pause" | "lost" (a node gone without notice)
    deadline: float  # the reclaimed node's deadline D, epoch seconds

    def to_dict(self) -> dict[str, Any]:
        # Shallow (every field is a plain value but `models`): asdict's deep copy cost a mass
        # reclamation a thousand of them.
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc["models"] = list(self.models)
        return doc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@dataclass(frozen=True)
class AcquisitionResult:
    request_id: str
    ok: bool
    detail: str
    duration_s: float
    response: dict[str, Any] | None = field(default=None, compare=False)  # the JSON answer, if any


class Acquirer(abc.ABC):
    """Asks for capacity. `request` never raises (except cancellation) and takes at most about
    `timeout_s`."""

    timeout_s: float

    async def request(self, req: AcquisitionRequest) -> AcquisitionResult:
        started = time.monotonic()
        try:
            ok, detail, response = await self._acquire(req)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never into the caller: a failing acquirer is a recorded fact
            ok, detail, response = False, f"{type(e).__name__}: {e}", None
        return AcquisitionResult(
            request_id=req.request_id,
            ok=ok,
            detail=detail,
            duration_s=time.monotonic() - started,
            response=response,
        )

    @abc.abstractmethod
    async def _acquire(self, req: AcquisitionRequest) -> tuple[bool, str, dict[str, Any] | None]:
        """(ok, detail, the JSON answer or None). May raise: `request` makes that ok=False."""


class ExecAcquirer(Acquirer):
    def __init__(self, argv: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not argv:
            raise ValueError("exec acquirer needs a command")
        self.argv = list(argv)
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"ExecAcquirer({self.argv!r}, timeout_s={self.timeout_s})"

    async def _acquire(self, req: AcquisitionRequest) -> tuple[bool, str, dict[str, Any] | None]:
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # its own process group, killed whole at the timeout
            )
        except OSError as e:
            return False, f"cannot run {self.argv[0]}: {e}", None
        try:
            async with asyncio.timeout(self.timeout_s):
                out, err = await proc.communicate(req.to_json().encode())
        except TimeoutError:
            _kill_group(proc.pid)
            await proc.wait()
            return False, f"timed out after {self.timeout_s:g} s; process group killed", None
        except BaseException:  # cancelled: leave nothing running behind us
            _kill_group(proc.pid)
            raise
        code = proc.returncode
        if code != 0:
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit {code}"
            return False, _with_tail(how, err), None
        return _parse_answer("exit 0", out)


class WebhookAcquirer(Acquirer):
    def __init__(
        self,
        url: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})

    def __repr__(self) -> str:  # headers may hold a secret: never print them
        return f"WebhookAcquirer({self.url!r}, timeout_s={self.timeout_s})"

    async def _acquire(self, req: AcquisitionRequest) -> tuple[bool, str, dict[str, Any] | None]:
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": req.request_id,
            **self.headers,
        }
        try:
            # The outer timeout bounds everything, the connection and reading the body included.
            async with asyncio.timeout(self.timeout_s):
                async with aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s)
                ) as session:
                    async with session.post(self.url, data=req.to_json(), headers=headers) as resp:
                        body = await resp.read()
                        status = resp.status
        except TimeoutError:
            return False, f"timed out after {self.timeout_s:g} s", None
        except aiohttp.ClientError as e:
            return False, f"POST {self.url}: {type(e).__name__}: {e}", None
        if not 200 <= status < 300:
            return False, _with_tail(f"HTTP {status}", body), None
        return _parse_answer(f"HTTP {status}", body)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone


def _with_tail(head: str, raw: bytes) -> str:
    tail = raw.decode(errors="replace").strip()[-_DETAIL_MAX:]
    return f"{head}: {tail}" if tail else head


def _parse_answer(head: str, raw: bytes) -> tuple[bool, str, dict[str, Any] | None]:
    """A success stays a success whatever the answer says; the answer only adds detail."""
    if not raw.strip():
        return True, head, None
    try:
        doc = json.loads(raw)
    except ValueError:
        return True, f"{head}; answer is not JSON, ignored", None
    if not isinstance(doc, dict):
        return True, f"{head}; answer is not a JSON object, ignored", None
    return True, head, doc


# --- configuration ------------------------------------------------------------------------------

_TOP_KEYS = {"groups", "avoid_s"}
_GROUP_KEYS = {"exec", "webhook", "timeout_s", "headers"}


def acquirers_from_config(doc: Mapping[str, Any]) -> dict[str, Acquirer]:
    """One acquirer per configured node group. Raises ValueError naming the bad entry."""
    unknown = set(doc) - _TOP_KEYS
    if unknown:
        raise ValueError(
            f"acquirers: unknown keys {sorted(unknown)} (allowed: {sorted(_TOP_KEYS)})"
        )
    if "avoid_s" in doc:
        _positive(doc["avoid_s"], "acquirers: avoid_s")
    groups = doc.get("groups", {})
    if not isinstance(groups, Mapping):
        raise ValueError(f"acquirers: groups must be a table, got {type(groups).__name__}")
    return {name: _group_acquirer(name, table) for name, table in groups.items()}


def avoid_s_from_config(doc: Mapping[str, Any]) -> float:
    """The avoidance window of the same config, default 300 s."""
    if "avoid_s" not in doc:
        return DEFAULT_AVOID_S
    return _positive(doc["avoid_s"], "acquirers: avoid_s")


def _group_acquirer(name: Any, table: Any) -> Acquirer:
    if not isinstance(name, str) or not name:
        raise ValueError(f"acquirers: group name must be a non-empty string, got {name!r}")
    where = f"acquirers: group {name!r}"
    if not isinstance(table, Mapping):
        raise ValueError(f"{where}: must be a table, got {type(table).__name__}")
    unknown = set(table) - _GROUP_KEYS
    if unknown:
        raise ValueError(
            f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(_GROUP_KEYS)})"
        )
    has_exec, has_webhook = "exec" in table, "webhook" in table
    if has_exec and has_webhook:
        raise ValueError(f"{where}: give exec or webhook, not both")
    if not has_exec and not has_webhook:
        raise ValueError(f"{where}: give exec (a command) or webhook (a URL)")
    timeout_s = _positive(table.get("timeout_s", DEFAULT_TIMEOUT_S), f"{where}: timeout_s")
    if has_exec:
        if "headers" in table:
            raise ValueError(f"{where}: headers apply to a webhook, not to exec")
        argv = table["exec"]
        if not isinstance(argv, list) or not argv:
            raise ValueError(f"{where}: exec must be a non-empty list of strings, got {argv!r}")
        if not all(isinstance(a, str) for a in argv) or not argv[0]:
            raise ValueError(f"{where}: exec must be strings, a program first, got {argv!r}")
        return ExecAcquirer(argv, timeout_s)
    url = table["webhook"]
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{where}: webhook must be an http:// or https:// URL, got {url!r}")
    headers = table.get("headers", {})
    if not isinstance(headers, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise ValueError(f"{where}: headers must be a table of strings")
    return WebhookAcquirer(url, timeout_s, headers)


def _positive(value: Any, what: str) -> float:
    # bool is an int in Python; `timeout_s = true` is a mistake, not 1 second.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be positive and finite, got {value!r}")
    return float(value)


# --- where to ask -------------------------------------------------------------------------------


class AvoidanceWindow:
    """Reclaimed groups, avoided for new placements and acquisitions until a time. Pure: the
    caller passes `now` (wall-clock epoch seconds, so a window can be stored and survive a restart).

    A second reclaim in an avoided group extends its window to `now + avoid_s` of the new reclaim:
    a group that keeps getting reclaimed keeps being avoided. A window is never shortened, not
    even by a reclaim reported late (an earlier `now`).
    """

    def __init__(self, avoid_s: float = DEFAULT_AVOID_S) -> None:
        self.avoid_s = _positive(avoid_s, "avoid_s")
        self._until: dict[str, float] = {}

    def avoid(self, group: str, now: float) -> float:
        """Start or extend the window of `group`; returns when it ends."""
        until = max(self._until.get(group, -math.inf), now + self.avoid_s)
        self._until[group] = until
        return until

    def is_avoided(self, group: str, now: float) -> bool:
        return now < self._until.get(group, -math.inf)

    def active(self, now: float) -> dict[str, float]:
        """The groups avoided at `now`, with their ends (the `avoided` of choose_target_group).
        Forgets windows that have ended."""
        self._until = {g: t for g, t in self._until.items() if now < t}
        return dict(self._until)


def choose_target_group(
    reclaimed_group: str,
    groups: Sequence[str],
    avoided: Mapping[str, float],
    now: float,
) -> str | None:
    """The first group of `groups` (the configured order is the operator's preference) that is
    not the reclaimed one and not avoided at `now` (`avoided`: group -> end of its window).
    None when there is none: the caller records that no replacement could be asked for."""
    for group in groups:
        if group == reclaimed_group:
            continue
        if now < avoided.get(group, -math.inf):
            continue
        return group
    return None
