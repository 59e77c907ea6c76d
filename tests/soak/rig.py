"""The soak's real parts: one `spotdrain-coordinator` (mutual TLS, SQLite) and several
`spotdrain-agent`s, each on fake GPUs over the real pynvml, all as processes
(tests/fakes/harness.py).

Each can be SIGKILLed and started again in place, as systemd's Restart= would: the coordinator
on the same store and port, an agent with the same arguments and state dir. A daemon that exits
without being killed is a crash: it is counted, and started again, so the soak goes on.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from fakes.fakenvml import FakeGpus
from fakes.harness import Agent, AgentOptions, Coordinator, start_agent, start_coordinator
from fakes.pki import Pki
from fakes.waiting import wait_until

from .observe import install_ledger

AGENT_UP = "agent up"
START_TIMEOUT_S = 60.0


class Rig:
    def __init__(
        self, work: Path, docker_host: str, nvml_lib: Path, nodes: int, options: AgentOptions
    ) -> None:
        self.work = work
        self.pki = Pki(work / "pki")
        self.coordinator: Coordinator = start_coordinator(work / "coordinator", tls=self.pki)
        self.port = int(self.coordinator.address.rsplit(":", 1)[1])
        self.lock = threading.Lock()  # one restart at a time, and none while the soak stops
        self.crashes: list[str] = []  # "coordinator exited 1", "soak-2 exited -6", ...
        self._coordinator_down = False  # killed on purpose, not yet started again
        self._agents_down: set[str] = set()
        self.agents: dict[str, Agent] = {}
        try:
            for i in range(nodes):
                node = f"soak-{i}"
                install_ledger(work / node / "state")
                gpus = FakeGpus(work / node / "gpus.state")
                gpus.set(gpus=1)
                self.agents[node] = start_agent(
                    work, node, self.coordinator, docker_host, gpus, nvml_lib, options
                )
        except BaseException:
            self.stop()
            raise

    # --- the coordinator ---------------------------------------------------------------------

    def kill_coordinator(self) -> None:
        with self.lock:
            self._coordinator_down = True
            self.coordinator.proc.kill()

    def start_coordinator_again(self) -> None:
        with self.lock:
            self._start_coordinator()
            self._coordinator_down = False

    def _start_coordinator(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                self.coordinator = start_coordinator(
                    self.work / "coordinator",
                    tls=self.pki,
                    db=self.coordinator.db,
                    port=self.port,
                )
                return
            except (RuntimeError, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)  # the port not free yet, or a slow start on a loaded host

    def freeze_coordinator(self) -> None:
        self.coordinator.proc.signal(signal.SIGSTOP)

    def thaw_coordinator(self) -> None:
        self.coordinator.proc.signal(signal.SIGCONT)

    # --- the agents --------------------------------------------------------------------------

    def kill_agent(self, node: str) -> None:
        with self.lock:
            self._agents_down.add(node)
            self.agents[node].proc.kill()

    def start_agent_again(self, node: str) -> None:
        with self.lock:
            self._restart_agent(node)
            self._agents_down.discard(node)

    def _restart_agent(self, node: str) -> None:
        agent = self.agents[node]
        offset = agent.log_path.stat().st_size
        agent.restart()
        wait_until(
            lambda: _since(agent.log_path, offset, AGENT_UP) or _exited(agent),
            START_TIMEOUT_S,
            f"agent {node} to start again",
            every=0.1,
        )

    # --- crashes -----------------------------------------------------------------------------

    def check_alive(self) -> None:
        """A daemon that exited though nobody killed it: counted, and started again."""
        with self.lock:
            code = self.coordinator.proc.popen.poll()
            if code is not None and not self._coordinator_down:
                self.crashes.append(f"coordinator exited {code} ({self.coordinator.proc.log_path})")
                self._start_coordinator()
            for node, agent in self.agents.items():
                code = agent.proc.popen.poll()
                if code is not None and node not in self._agents_down:
                    self.crashes.append(f"{node} exited {code} ({agent.log_path})")
                    self._restart_agent(node)

    def stop(self) -> None:
        with self.lock:
            for agent in self.agents.values():
                agent.proc.stop()
            self.coordinator.proc.stop()


def _since(path: Path, offset: int, text: str) -> bool:
    with open(path, "rb") as f:
        f.seek(offset)
        return text.encode() in f.read()


def _exited(agent: Agent) -> bool:
    if agent.proc.popen.poll() is not None:
        raise RuntimeError(
            f"agent {agent.node_id} exited {agent.proc.popen.returncode} "
            f"while starting again; see {agent.log_path}"
        )
    return False
