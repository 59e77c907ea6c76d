"""GPU observation through NVML (the real `pynvml`): which processes hold a GPU.

NVML is initialised once and called from one dedicated thread, never from the event loop, each
call with a timeout. Any failure (no driver, GPU lost, a call that hangs) is an error, never an
empty answer: an observation that failed is not "empty" (docs/design.md invariant 5).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("spotdrain.agent.host.gpu")

SIZE_RETRIES = 5  # processes can appear between NVML's sizing call and the fill


class GpuError(Exception):
    pass


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_bytes: int


@dataclass(frozen=True)
class GpuProcess:
    gpu: int
    pid: int
    kind: str  # "compute" or "graphics"
    used_bytes: int


class Nvml:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        # One thread: NVML is initialised on it and every call runs on it, in order.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvml")
        self._initialised = False
        self._pynvml: Any = None

    async def _run(self, fn: Any) -> Any:
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self._thread, fn), self.timeout_s)
        except TimeoutError as e:
            raise GpuError(f"NVML did not answer within {self.timeout_s} s") from e

    def _ensure_init(self) -> Any:
        if self._pynvml is None:
            import pynvml  # noqa: PLC0415 (kept off import time: it loads libnvidia-ml)

            self._pynvml = pynvml
        if not self._initialised:
            try:
                self._pynvml.nvmlInit()
            except self._pynvml.NVMLError as e:
                raise GpuError(f"NVML init failed: {e}") from e
            self._initialised = True
        return self._pynvml

    async def inventory(self) -> list[GpuInfo]:
        def read() -> list[GpuInfo]:
            nv = self._ensure_init()
            try:
                gpus = []
                for i in range(nv.nvmlDeviceGetCount()):
                    h = nv.nvmlDeviceGetHandleByIndex(i)
                    gpus.append(
                        GpuInfo(
                            index=i,
                            uuid=_text(nv.nvmlDeviceGetUUID(h)),
                            name=_text(nv.nvmlDeviceGetName(h)),
                            memory_bytes=int(nv.nvmlDeviceGetMemoryInfo(h).total),
                        )
                    )
                return gpus
            except nv.NVMLError as e:
                raise GpuError(f"NVML: {e}") from e

        return await self._run(read)

    async def processes(self) -> list[GpuProcess]:
        """Every compute and graphics process on every GPU. Raises GpuError, never guesses."""

        def read() -> list[GpuProcess]:
            nv = self._ensure_init()
            found: list[GpuProcess] = []
            try:
                for i in range(nv.nvmlDeviceGetCount()):
                    h = nv.nvmlDeviceGetHandleByIndex(i)
                    for kind, call in (
                        ("compute", nv.nvmlDeviceGetComputeRunningProcesses),
                        ("graphics", nv.nvmlDeviceGetGraphicsRunningProcesses),
                    ):
                        for p in _sized(nv, call, h):
                            used = p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else 0
                            found.append(GpuProcess(i, int(p.pid), kind, used))
            except nv.NVMLError as e:
                raise GpuError(f"NVML: {e}") from e
            return found

        return await self._run(read)

    def close(self) -> None:
        if self._initialised:
            self._thread.submit(self._pynvml.nvmlShutdown)
        self._thread.shutdown(wait=False)


def _sized(nv: Any, call: Any, handle: Any) -> list[Any]:
    # pynvml retries a too-small buffer only once; a busy GPU can outgrow it again.
    for attempt in range(SIZE_RETRIES):
        try:
            return list(call(handle))
        except nv.NVMLError_InsufficientSize:
            if attempt == SIZE_RETRIES - 1:
                raise
    raise AssertionError("unreachable")


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
