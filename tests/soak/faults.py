"""The fault injector: on a thread of its own, at random moments (between reclamations and in
the middle of them: it knows nothing of the rounds), one fault at a time:

  coordinator_kill    SIGKILL, then started again on the same store and port after 0-2 s
  coordinator_freeze  SIGSTOP for 0.3-3 s (calls neither answer nor fail), then SIGCONT
  agent_kill          one agent SIGKILLed, then started again after 0-1 s, as systemd would

Every fault is logged with its wall-clock span, so a reclamation's report can name the faults
that overlapped it. The injector also watches for daemons that exited by themselves (Rig).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

from .rig import Rig

KINDS = ("coordinator_kill", "coordinator_freeze", "agent_kill")
WEIGHTS = (1, 1, 2)


@dataclass(frozen=True)
class Fault:
    kind: str
    target: str  # "coordinator" or the node id
    start: float  # wall time
    end: float  # wall time the target was back (started again, or continued)


class FaultInjector:
    def __init__(
        self, rig: Rig, rng: random.Random, every_s: tuple[float, float], enabled: bool = True
    ) -> None:
        self.rig = rig
        self.rng = rng
        self.every_s = every_s
        self.enabled = enabled
        self.log: list[Fault] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="faults", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No more faults; whatever is down is back up when this returns."""
        self._stop.set()
        self._thread.join()
        self.rig.thaw_coordinator()
        if self.error is not None:
            raise RuntimeError("the fault injector failed") from self.error

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._pause()):
                if self.enabled:
                    self._inject(self.rng.choices(KINDS, WEIGHTS)[0])
                self.rig.check_alive()
        except BaseException as e:  # noqa: BLE001 (stop() re-raises it on the soak's thread)
            self.error = e

    def _pause(self) -> float:
        if not self.enabled:
            return 0.5  # only the crash watch
        return self.rng.uniform(*self.every_s)

    def _inject(self, kind: str) -> None:
        start = time.time()
        if kind == "coordinator_kill":
            target = "coordinator"
            self.rig.kill_coordinator()
            time.sleep(self.rng.uniform(0.0, 2.0))
            self.rig.start_coordinator_again()
        elif kind == "coordinator_freeze":
            target = "coordinator"
            self.rig.freeze_coordinator()
            time.sleep(self.rng.uniform(0.3, 3.0))
            self.rig.thaw_coordinator()
        else:
            target = self.rng.choice(sorted(self.rig.agents))
            self.rig.kill_agent(target)
            time.sleep(self.rng.uniform(0.0, 1.0))
            self.rig.start_agent_again(target)
        self.log.append(Fault(kind, target, start, time.time()))

    def overlapping(self, start: float, end: float, node: str) -> list[Fault]:
        """The faults that hit a reclamation of `node` between start and end."""
        return [
            f
            for f in self.log
            if f.start <= end and f.end >= start and f.target in ("coordinator", node)
        ]
