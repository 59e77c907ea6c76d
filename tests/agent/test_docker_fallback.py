"""When the Docker engine hangs, the provider's deadline does not wait: the agent signals the
container's process by its PID, from the inventory it kept while the engine was healthy."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import threading

from spotdrain.agent.workloads.docker_engine import ContainerInfo, DockerEngine, DockerUnavailable


class HungEngine:
    """A unix socket that accepts connections and never answers, like a wedged dockerd."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(64)
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


async def test_hung_engine_falls_back_to_signalling_the_pid(tmp_path):
    """dockerd stops answering mid-reclamation. Listing and killing both time out; the agent
    signals each container's PID from its inventory and says it went that way."""
    engine = HungEngine(str(tmp_path / "docker.sock"))
    job = subprocess.Popen(["sleep", "60"])
    other = subprocess.Popen(["sleep", "60"])
    docker = DockerEngine(f"unix://{tmp_path}/docker.sock", "node-a", call_timeout_s=0.3)
    try:
        docker.inventory = {"c1": ContainerInfo("c1", "job", "batch", job.pid)}
        results = [r async for r in docker.signal_all("SIGTERM")]
        assert [(r.container, r.via, r.error) for r in results] == [("c1", "pid", "")]
        assert job.wait(5) == -15
        assert other.poll() is None  # not in this node's inventory: untouched
    finally:
        job.kill()
        other.kill()
        docker.close()
        engine.close()


async def test_hung_engine_observation_is_an_error_not_empty(tmp_path):
    """Verification asks a hung engine: that is an error, never an empty node."""
    engine = HungEngine(str(tmp_path / "docker.sock"))
    docker = DockerEngine(f"unix://{tmp_path}/docker.sock", "node-a", call_timeout_s=0.3)
    try:
        try:
            await docker.running()
        except DockerUnavailable as e:
            assert "Timeout" in str(e) or "did not answer" in str(e)
        else:
            raise AssertionError("a hung engine answered")
    finally:
        docker.close()
        engine.close()


async def test_pid_unknown_is_a_failed_signal(tmp_path):
    engine = HungEngine(str(tmp_path / "docker.sock"))
    docker = DockerEngine(f"unix://{tmp_path}/docker.sock", "node-a", call_timeout_s=0.2)
    try:
        docker.inventory = {"c1": ContainerInfo("c1", "job", "batch", 0)}
        results = [r async for r in docker.signal_all("SIGKILL")]
        assert len(results) == 1 and "PID is unknown" in results[0].error
    finally:
        docker.close()
        engine.close()
        await asyncio.sleep(0)
