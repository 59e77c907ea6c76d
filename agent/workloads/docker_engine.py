"""Docker Engine adapter: signal, wait and list this node's containers, returning events.

Only containers labelled `spotdrain.node=<this node>` are ever touched (docs/design.md "Four drain
paths"). Every call has its own timeout. If the engine hangs on a kill, the agent signals the
container's PID itself, from an inventory it keeps fresh in the background, because the
provider's deadline does not wait for a stuck daemon (docs/design.md step 4).

Blocking docker-py calls run on a dedicated thread pool sized for many containers at once, so
the signals of one round go out concurrently, not a few at a time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal as signals
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import docker
import docker.errors

from spotdrain.agent.core.reclamation_events import ContainerExited, ContainerSignalled
from spotdrain.workload import KIND_LABEL, NODE_LABEL

log = logging.getLogger("spotdrain.agent.docker")

# Pinned so no call is made at construction (auto-detection would hang with the engine).
API_VERSION = "1.41"
RENTAL_KIND = "rental"


class DockerUnavailable(Exception):
    pass


async def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """Run a call that may block for as long as a container lives, in a daemon thread.

    A pool thread would be joined at interpreter exit, so an agent stopping (or restarting)
    mid-reclamation would hang until every watched container exited. A daemon thread is
    abandoned instead; the restarted agent waits again from its bundle.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the awaiting task)
            if not loop.is_closed():
                loop.call_soon_threadsafe(_settle, future, None, e)
            return
        if not loop.is_closed():
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=run, name="docker-wait", daemon=True).start()
    return await future


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


@dataclass(frozen=True)
class ContainerInfo:
    id: str
    name: str
    kind: str
    pid: int
    labels: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    image: str = ""  # as the container was created from (its contract is tracked by image)


class DockerEngine:
    def __init__(
        self,
        host: str,
        node_id: str,
        call_timeout_s: float,
        clock: Callable[[], float] = time.time,
        pool_size: int = 64,
    ) -> None:
        self.node_id = node_id
        self.call_timeout_s = call_timeout_s
        self.clock = clock
        self._pool = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix="docker")
        self._api = docker.APIClient(
            base_url=host, version=API_VERSION, timeout=call_timeout_s, max_pool_size=pool_size
        )
        # Waits block until the container exits: their own client with no short timeout.
        self._waits = docker.APIClient(
            base_url=host, version=API_VERSION, timeout=None, max_pool_size=pool_size
        )
        self.inventory: dict[str, ContainerInfo] = {}

    def close(self) -> None:
        self._api.close()
        self._waits.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        try:
            # The HTTP client times out too; this is the backstop if a thread is wedged.
            return await asyncio.wait_for(future, self.call_timeout_s + 0.5)
        except TimeoutError as e:
            raise DockerUnavailable(f"engine did not answer within {self.call_timeout_s} s") from e
        except docker.errors.APIError as e:
            # 404 (gone) and 409 (not running) are answers, not a hung engine: a caller that
            # took them for one would fall back to a cached PID, which may have been reused.
            if e.status_code in (404, 409):
                raise
            raise DockerUnavailable(f"{type(e).__name__}: {e}") from e
        except Exception as e:  # requests, urllib3 and socket errors all mean the same here
            raise DockerUnavailable(f"{type(e).__name__}: {e}") from e

    # --- listing -----------------------------------------------------------------------------

    async def running(self, with_labels: bool = False) -> list[ContainerInfo]:
        """Running containers with this node's label, from the engine (raises if it fails)."""
        rows = await self._call(
            self._api.containers, filters={"label": f"{NODE_LABEL}={self.node_id}"}
        )
        found = []
        for row in rows:
            labels = row.get("Labels") or {}
            if labels.get(NODE_LABEL) != self.node_id:  # belt and braces over the filter
                continue
            cached = self.inventory.get(row["Id"])
            found.append(
                ContainerInfo(
                    id=row["Id"],
                    name=(row.get("Names") or ["/" + row["Id"][:12]])[0].lstrip("/"),
                    kind=labels.get(KIND_LABEL, ""),
                    pid=cached.pid if cached else 0,
                    labels=dict(labels) if with_labels else {},
                    image=str(row.get("Image") or ""),
                )
            )
        return found

    async def refresh_inventory(self) -> None:
        """Remember each running container's PID for the hung-engine fallback."""
        fresh: dict[str, ContainerInfo] = {}
        for info in await self.running():
            pid = info.pid
            if not pid:
                try:
                    state = (await self._call(self._api.inspect_container, info.id))["State"]
                except docker.errors.NotFound:
                    continue
                pid = int(state.get("Pid") or 0)
            fresh[info.id] = ContainerInfo(info.id, info.name, info.kind, pid, image=info.image)
        self.inventory = fresh

    async def sigterms_since(self, since: float, until: float) -> set[str] | None:
        """The containers the engine was asked to SIGTERM between `since` and `until` (its
        own `kill` events, signal 15), or None when the engine cannot tell (not answering).
        A restarted agent asks this of the SIGTERMs its predecessor announced: delivered ones
        are never sent again, the others still are (a SIGKILL between the announcement and
        the kill call left the job without any SIGTERM)."""

        def kills() -> list[dict[str, Any]]:
            return list(
                self._api.events(
                    since=int(since) - 1,  # whole seconds: the announcement's own second too
                    until=int(until) + 1,
                    filters={"type": "container", "event": "kill"},
                    decode=True,
                )
            )

        try:
            events = await self._call(kills)
        except (DockerUnavailable, docker.errors.APIError) as e:
            log.warning("node %s: cannot read the engine's kill events: %s", self.node_id, e)
            return None
        return {
            e.get("Actor", {}).get("ID", "")
            for e in events
            if e.get("Actor", {}).get("Attributes", {}).get("signal") in ("15", "SIGTERM")
        }

    # --- signalling --------------------------------------------------------------------------

    async def signal_all(
        self,
        signal: str,
        skip: frozenset[str] = frozenset(),
        skip_kinds: frozenset[str] = frozenset(),
    ) -> AsyncIterator[ContainerSignalled]:
        """Signal every running container of this node concurrently; yield each result.

        `skip_kinds`: drain kinds that are not signalled in this round (inference workers drain
        through their slot gate, not by SIGTERM)."""
        async for result in self.signal_each(await self.targets(skip, skip_kinds), signal):
            yield result

    async def targets(
        self, skip: frozenset[str] = frozenset(), skip_kinds: frozenset[str] = frozenset()
    ) -> list[ContainerInfo]:
        """The running containers of this node a round would signal: from the engine, or from
        the inventory when the engine does not answer (it may be hung on kills too)."""
        try:
            found = await self.running()
        except DockerUnavailable as e:
            log.warning("node %s: listing containers failed (%s); using inventory", self.node_id, e)
            found = list(self.inventory.values())
        return [t for t in found if t.id not in skip and t.kind not in skip_kinds]

    async def signal_each(
        self, targets: list[ContainerInfo], signal: str
    ) -> AsyncIterator[ContainerSignalled]:
        """Signal exactly these containers concurrently; yield each result as it comes."""
        tasks = [asyncio.create_task(self._signal_one(t, signal)) for t in targets]
        for done in asyncio.as_completed(tasks):
            yield await done

    async def _signal_one(self, target: ContainerInfo, signal: str) -> ContainerSignalled:
        def sent(via: str) -> ContainerSignalled:
            return ContainerSignalled(
                self.clock(),
                target.id,
                target.name,
                signal,
                via,
                image=target.image,
                kind=target.kind,
            )

        def failed(error: str) -> ContainerSignalled:
            return ContainerSignalled(
                self.clock(), target.id, target.name, signal, "pid", error=error
            )

        try:
            await self._call(self._api.kill, target.id, signal=signal)
            return sent("api")
        except docker.errors.NotFound:
            # Gone between listing and killing: nothing left to signal.
            return sent("api")
        except docker.errors.APIError as e:
            if e.response is not None and e.response.status_code == 409:  # not running any more
                return sent("api")
            api_error = str(e)
        except DockerUnavailable as e:
            api_error = str(e)
        pid = target.pid or getattr(self.inventory.get(target.id), "pid", 0)
        if not pid:
            return failed(f"engine failed ({api_error}) and the PID is unknown")
        try:
            os.kill(pid, getattr(signals, signal))
        except ProcessLookupError:
            pass  # already gone: the signal's purpose is met
        except OSError as e:
            return failed(f"engine failed ({api_error}); kill({pid}): {e.strerror}")
        log.warning(
            "node %s: engine failed (%s); signalled %s by PID %d",
            self.node_id,
            api_error,
            target.name,
            pid,
        )
        return sent("pid")

    async def kill(self, container_id: str, name: str, signal: str) -> ContainerSignalled:
        info = self.inventory.get(container_id) or ContainerInfo(container_id, name, "", 0)
        return await self._signal_one(info, signal)

    async def run_container(
        self,
        image: str,
        name: str,
        labels: dict[str, str],
        env: dict[str, str],
        binds: dict[str, dict[str, str]] | None = None,
    ) -> tuple[str, str]:
        """Create and start a workload container on the host network; (id, name).

        `binds`: host path -> {"bind": path in the container, "mode": "ro" or "rw"}. A stopped
        container of the same name (an earlier run of the same worker or rental) is removed
        first; a running one is left alone and the start fails."""
        loop = asyncio.get_running_loop()

        def create() -> str:
            host_config = self._waits.create_host_config(network_mode="host", binds=binds)
            created = self._waits.create_container(
                image, name=name, labels=labels, environment=env, host_config=host_config
            )
            return str(created["Id"])

        def create_and_start() -> str:
            try:
                container_id = create()
            except docker.errors.APIError as e:
                if e.status_code != 409:
                    raise
                old = self._waits.inspect_container(name)
                labels_of_old = old["Config"].get("Labels") or {}
                if old["State"].get("Running") or labels_of_old.get(NODE_LABEL) != self.node_id:
                    raise
                self._waits.remove_container(old["Id"], force=True)
                container_id = create()
            self._waits.start(container_id)
            return container_id

        try:
            # Creating a container copies its image on some storage drivers: a longer timeout.
            container_id = await asyncio.wait_for(
                loop.run_in_executor(self._pool, create_and_start), 60
            )
        except TimeoutError as e:
            raise DockerUnavailable(f"starting {name} took over 60 s") from e
        except Exception as e:  # noqa: BLE001 (docker-py raises many kinds)
            raise DockerUnavailable(f"starting {name}: {e}") from e
        return container_id, name

    # --- exits -------------------------------------------------------------------------------

    async def wait_exit(self, container_id: str, name: str) -> ContainerExited:
        """Block until the container stops; its exit code as the engine reports it."""
        while True:
            try:
                result = await _in_daemon_thread(lambda: self._waits.wait(container_id))
                return ContainerExited(
                    self.clock(), container_id, name, int(result.get("StatusCode", -1))
                )
            except docker.errors.NotFound:
                # Removed (auto-remove) before we could read its code.
                return ContainerExited(self.clock(), container_id, name, -1)
            except Exception as e:  # the engine went away; keep waiting once it is back
                log.warning("node %s: waiting for %s failed: %s", self.node_id, name, e)
                await asyncio.sleep(0.5)
