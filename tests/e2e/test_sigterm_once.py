"""SIGTERM at most once, across an agent SIGKILLed mid-round (issue 11, item 7), on real parts:
a coordinator and an agent as processes, a real Docker engine, the real pynvml over the fake
library. The agent reaches the engine through a pass-through socket that holds back the answer
to the first SIGTERM and kills the agent right then: the signal is delivered, and the agent
never learns it was."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fakes.dockerenv import run_workload
from fakes.harness import AgentOptions, start_agent
from fakes.waiting import wait_until

pytestmark = pytest.mark.docker

KILL_SIGTERM = re.compile(rb"POST /[^ ]*containers/[^/ ]+/kill\?signal=SIGTERM ")


class KillTrap:
    """A unix socket in front of the Docker engine that passes every byte through, except the
    answer to the first `kill?signal=SIGTERM`: that one is dropped and `on_trip` called instead
    (the request itself reached the engine, so the container got its SIGTERM). HTTP/1.1 answers
    a connection's requests in order, so the first bytes back after that request are its answer.
    With `drop_request`, the request itself is dropped and `on_trip` called: the engine never
    hears of it.
    """

    def __init__(
        self, path: Path, upstream: str, on_trip: Callable[[], None], drop_request: bool = False
    ) -> None:
        self.upstream = upstream.removeprefix("unix://")
        self.on_trip = on_trip
        self.drop_request = drop_request
        self.tripped = threading.Event()
        self._lock = threading.Lock()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(64)
        self.address = f"unix://{path}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            engine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            engine.connect(self.upstream)
            asked = threading.Event()  # a SIGTERM kill on this connection awaits its answer
            threading.Thread(
                target=self._requests, args=(client, engine, asked), daemon=True
            ).start()
            threading.Thread(
                target=self._answers, args=(engine, client, asked), daemon=True
            ).start()

    def _requests(self, client: socket.socket, engine: socket.socket, asked: threading.Event):
        try:
            while data := client.recv(65536):
                if not self.tripped.is_set() and KILL_SIGTERM.search(data):
                    if self.drop_request:
                        self.tripped.set()
                        self.on_trip()
                        return
                    asked.set()
                engine.sendall(data)
        except OSError:
            pass
        finally:
            engine.close()

    def _answers(self, engine: socket.socket, client: socket.socket, asked: threading.Event):
        try:
            while data := engine.recv(65536):
                if asked.is_set():
                    with self._lock:
                        first = not self.tripped.is_set()
                        self.tripped.set()
                    if first:
                        self.on_trip()
                        return
                client.sendall(data)
        except OSError:
            pass
        finally:
            client.close()

    def close(self) -> None:
        self.sock.close()


@dataclass
class KilledMidRound:
    """A job that traps TERM, counts it and carries on; an agent whose engine socket goes
    through a KillTrap; the notice sent and the agent SIGKILLed at the trap."""

    stubborn: Any
    agent: Any
    trap: KillTrap
    admin: Any

    def bundle(self) -> dict:
        """The reclamation's bundle as the restarted agent will find it."""
        [path] = (self.agent.state_dir / "reclamations").glob("rcl-*.json")
        return json.loads(path.read_text())

    def restart_until_drained(self) -> tuple[list[dict], dict]:
        """The agent started again and the node drained: the job heard exactly one SIGTERM.
        The reclamation's events, and its notice."""
        self.agent.restart()
        drained = self.admin.wait_for("drained", node="node-a", timeout=30)
        assert self.stubborn.logs().decode().count("SIGTERM ignored") == 1
        events = self.admin.events(node="node-a", reclaim_id=drained["reclaim_id"])
        notice = next(e for e in events if e["kind"] == "notice_received")
        return events, notice

    def close(self) -> None:
        self.agent.proc.stop()
        self.trap.close()


def killed_mid_round(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib, containers, drop_request: bool
) -> KilledMidRound:
    stubborn = run_workload(
        docker_engine.client, name=containers + "stubborn", node_id="node-a", kind="ignores_term"
    )
    agent_box: dict = {}

    def kill_agent() -> None:
        os.kill(agent_box["agent"].proc.pid, signal.SIGKILL)

    trap = KillTrap(
        tmp_path / "engine-proxy.sock", docker_engine.host, kill_agent, drop_request=drop_request
    )
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        trap.address,
        gpus,
        nvml_lib,
        AgentOptions(grace_s=5.0, overrun_s=1.0),
    )
    agent_box["agent"] = agent
    run = KilledMidRound(stubborn, agent, trap, coordinator.admin())
    try:
        wait_until(lambda: any(n.connected for n in run.admin.nodes()), 10, "node-a to register")
        agent.write_notice(
            {"id": "once-1", "action": "terminate", "terminate_at": time.time() + 12}
        )
        assert trap.tripped.wait(10), "the agent never sent its SIGTERM"
        agent.proc.popen.wait(10)
        assert agent.proc.popen.returncode == -signal.SIGKILL
    except BaseException:
        run.close()
        raise
    return run


def test_an_agent_killed_after_its_sigterm_reached_the_engine_never_sends_a_second(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib, containers
):
    """A job traps TERM, counts it and carries on. The notice comes; the agent's SIGTERM
    reaches the engine and the job, and the agent is SIGKILLed before the engine's answer
    arrives. The bundle on disk already names the job as announced (written before the
    signal). The restarted agent sends it no second SIGTERM, reports the first one as sent
    by the previous run, and kills the job at the original G; the node drains."""
    run = killed_mid_round(
        tmp_path, docker_engine, coordinator, gpus, nvml_lib, containers, drop_request=False
    )
    stubborn = run.stubborn
    try:
        wait_until(
            lambda: stubborn.logs().decode().count("SIGTERM ignored") == 1,
            5,
            "the job to hear the SIGTERM",
        )
        bundle = run.bundle()
        # The job heard SIGTERM exactly once: not again from the restarted agent.
        events, notice = run.restart_until_drained()
        sigterms = [e for e in events if e["kind"] == "sigterm_sent"]
        assert len(sigterms) == 1
        assert sigterms[0]["by"] == "previous run" and sigterms[0]["container"] == stubborn.id
        assert sigterms[0]["image"]  # its image's contract counts it (coordinator/core/timeline.py)
        kills = [e for e in events if e["kind"] == "sigkill_sent"]
        assert [k["container"] for k in kills] == [stubborn.id]
        assert kills[0]["wall_time"] >= notice["grace_deadline"]  # at G, not before
        stubborn.reload()
        assert stubborn.attrs["State"]["ExitCode"] == 137
        assert [e["kind"] for e in events].count("notice_received") == 1
        assert list(bundle.get("announced", {})) == [stubborn.id]  # on disk before it was sent
        assert bundle["signalled"] == {}  # the answer died with the agent
    finally:
        run.close()


def test_an_agent_killed_before_its_sigterm_reached_the_engine_sends_it_after_the_restart(
    tmp_path, docker_engine, coordinator, gpus, nvml_lib, containers
):
    """The same job, but the agent is SIGKILLed as its SIGTERM leaves for the engine, which
    never receives it: announced in the bundle, delivered to nobody. The restarted agent asks
    the engine what it was asked to send (its kill events), finds no SIGTERM, and sends one
    itself: the job hears exactly one, before G. (Counted as sent by the previous run, the
    job would have had none and been killed at G.)"""
    run = killed_mid_round(
        tmp_path, docker_engine, coordinator, gpus, nvml_lib, containers, drop_request=True
    )
    stubborn = run.stubborn
    try:
        assert list(run.bundle().get("announced", {})) == [stubborn.id]  # announced, never sent
        assert "SIGTERM ignored" not in stubborn.logs().decode()
        events, notice = run.restart_until_drained()  # its one SIGTERM, from the new agent
        sigterms = [e for e in events if e["kind"] == "sigterm_sent"]
        assert [(e["container"], e.get("by", "")) for e in sigterms] == [(stubborn.id, "")]
        assert sigterms[0]["wall_time"] < notice["grace_deadline"]
        kills = [e for e in events if e["kind"] == "sigkill_sent"]
        assert [k["container"] for k in kills] == [stubborn.id]
        assert kills[0]["wall_time"] >= notice["grace_deadline"]  # at G, not before
    finally:
        run.close()
