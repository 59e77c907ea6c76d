"""The host's own shutdown, end to end: on a fresh Debian 12 with systemd as PID 1 and the agent
package installed, `systemctl poweroff` with a labelled batch job running. logind announces the
shutdown and holds it for the agent's delay lock; the agent drains the node (taint, SIGTERM, the
job checkpoints and exits, verified empty), its events reach a coordinator outside the host,
and only then does it release the lock, so systemd powers the host off right after the drain:
not before it, and not at the end of logind's delay either.

The poweroff ends the container, so this module boots a host of its own (tests/e2e/test_packaging.py
shares one across its tests). The host's journal is written to a directory of the test's
(bind-mounted at /var/log/journal), so the agent's and systemd's own lines, with their times,
are still there to read once the host is gone; a unit ordered before the agent notes the moment
the agent has stopped in another bind-mounted directory.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path

import docker.types
import pytest
from test_packaging import debs  # noqa: F401  (the module-scoped fixture: both packages)

from fakes.dockerenv import DockerEngine, SignalProbe, remove_test_containers, run_workload
from fakes.fakenvml import LIB_NAME, build
from fakes.harness import start_coordinator
from fakes.waiting import wait_until
from images.systemd_debian import boot, ensure_systemd_image

log = logging.getLogger("spotdrain.tests.shutdown_poweroff")

NODE = f"poweroff-node-{os.getpid()}"
PREFIX = f"sdt-poweroff-{os.getpid()}-"
FAKE_NVML_DIR = "/usr/local/lib/spotdrain-test"
GPUS_STATE = "/etc/spotdrain-test/gpus.state"
MARKS = "/srv/spotdrain-test"  # bind-mounted from the test's directory
CHECKPOINT_S = 2.0  # how long the job checkpoints after SIGTERM
LOGIND_DELAY_S = 30.0  # the package's logind drop-in (InhibitDelayMaxSec)

# Ordered Before= the agent, so at shutdown it stops after the agent has stopped: its ExecStop
# is the moment the agent was gone.
STOP_CLOCK_UNIT = f"""[Unit]
Description=test: note when spotdrain-agent has stopped
Before=spotdrain-agent.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/true
ExecStop=/bin/sh -c 'date +%%s.%%N > {MARKS}/agent-stopped'

[Install]
WantedBy=multi-user.target
"""


def _iso(text: str) -> float:
    """Docker's RFC 3339 time with nanoseconds, as epoch seconds."""
    head, _, frac = text.rstrip("Z").partition(".")
    return datetime.fromisoformat(head + "+00:00").timestamp() + float("0." + (frac or "0"))


def _journal(directory: Path) -> list[dict]:
    out = subprocess.run(
        ["journalctl", "-D", str(directory), "-o", "json", "--no-pager"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _at(entries: list[dict], text: str, **fields: str) -> float:
    """When the first journal entry whose MESSAGE contains `text` (and has `fields`) was logged."""
    for e in entries:
        message = e.get("MESSAGE")
        if (
            isinstance(message, str)
            and text in message
            and all(e.get(k) == v for k, v in fields.items())
        ):
            return int(e["__REALTIME_TIMESTAMP"]) / 1e6
    raise AssertionError(f"no journal entry with {text!r} {fields or ''}")


@pytest.mark.docker
def test_poweroff_waits_for_the_drain_and_not_longer(
    debs,
    docker_engine: DockerEngine,
    docker_images: dict[str, str],
    tmp_path: Path,
):
    """`systemctl poweroff` on a host running a batch job that checkpoints for 2 s after
    SIGTERM: notice_received (source shutdown, D = T0 + logind's 30 s) -> sigterm_sent ->
    container_exited (0) -> verified_empty at the coordinator outside; the agent releases
    logind's lock right after and the host goes down a few tenths of a second later, long
    before the 30 s logind would have waited."""
    client = docker_engine.client
    remove_test_containers(client, PREFIX)
    assert docker_engine.host.startswith("unix://"), docker_engine.host
    socket = docker_engine.host.removeprefix("unix://")
    marks = tmp_path / "marks"
    journal = tmp_path / "journal"
    marks.mkdir()
    journal.mkdir()
    image = ensure_systemd_image(client, tmp_path / "rootfs")
    probe = SignalProbe(tmp_path / "probe")
    coordinator = start_coordinator(tmp_path / "coordinator")
    try:
        system = boot(
            client,
            name=PREFIX + "host",
            image=image,
            mounts=[
                docker.types.Mount("/run/docker.sock", socket, type="bind"),
                docker.types.Mount(MARKS, str(marks), type="bind"),
                docker.types.Mount("/var/log/journal", str(journal), type="bind"),
            ],
        )
        system.put("/tmp/debs/" + debs.agent.name, debs.agent.read_bytes())
        system.sh(
            "apt-get update -qq && apt-get install -y -qq --no-install-recommends "
            f"/tmp/debs/{debs.agent.name}",
            env={"DEBIAN_FRONTEND": "noninteractive"},
        )
        # The package's drop-in, in force at once (postinst sends logind SIGHUP).
        delay = system.sh(
            "busctl get-property org.freedesktop.login1 /org/freedesktop/login1 "
            "org.freedesktop.login1.Manager InhibitDelayMaxUSec"
        )[1].split()
        assert delay == ["t", str(int(LOGIND_DELAY_S * 1e6))], delay
        lib = build(tmp_path / "nvml") / LIB_NAME
        system.put(f"{FAKE_NVML_DIR}/{LIB_NAME}", lib.read_bytes(), 0o755)
        system.put(GPUS_STATE, b"gpus 1\n")
        system.put(
            "/etc/systemd/system/spotdrain-agent.service.d/fake-nvml.conf",
            f"[Service]\nEnvironment=LD_LIBRARY_PATH={FAKE_NVML_DIR} "
            f"FAKE_NVML_STATE={GPUS_STATE}\n".encode(),
        )
        system.put(
            "/etc/spotdrain/agent.toml",
            (
                f'coordinator = "{coordinator.address}"\nnode_id = "{NODE}"\n'
                'docker_host = "unix:///run/docker.sock"\ninsecure = true\n'
                "[sources]\nauto = false\n[sources.shutdown]\n[sources.file]\n"
            ).encode(),
        )
        system.put(
            "/etc/systemd/system/spotdrain-test-stop-clock.service", STOP_CLOCK_UNIT.encode()
        )
        system.sh("systemctl daemon-reload && systemctl enable --now spotdrain-test-stop-clock")
        system.sh("systemctl restart spotdrain-agent")
        admin = coordinator.admin()
        wait_until(lambda: any(n.node_id == NODE for n in admin.nodes()), 20, f"{NODE} to register")
        wait_until(
            lambda: "spotdrain-agent" in system.sh("systemd-inhibit --list --no-pager")[1],
            20,
            "the agent's delay lock",
        )
        locks = system.sh("systemd-inhibit --list --no-pager")[1].splitlines()
        mode = [line.split()[-1] for line in locks if line.startswith("spotdrain-agent ")]
        assert mode == ["delay"] and " shutdown " in "\n".join(locks), locks

        job = run_workload(
            client,
            name=PREFIX + "batch",
            node_id=NODE,
            kind="checkpoints",
            env={"CHECKPOINT_S": str(CHECKPOINT_S), **probe.env},
            mounts=[probe.mount],
        )
        signals: list = []
        reader = threading.Thread(target=lambda: signals.append(probe.read(60)), daemon=True)
        reader.start()

        poweroff_at = time.time()
        system.sh("systemctl poweroff", check=False)  # logind takes it; systemctl returns
        system.container.wait(timeout=90)
        system.container.reload()
        host_down = _iso(system.container.attrs["State"]["FinishedAt"])
        reader.join(5)
        job.reload()
        job_state = job.attrs["State"]

        events = admin.events(NODE)
        received = next(
            e for e in events if e["kind"] == "notice_received" and e["source"] == "shutdown"
        )
        rid = received["reclaim_id"]
        mine = [e for e in events if e["reclaim_id"] == rid]
        first = {}
        for e in mine:
            first.setdefault(e["kind"], e)
        entries = _journal(journal)
        released = _at(entries, "delay lock released: reclamation drained")
        agent_stopped = float((marks / "agent-stopped").read_text())
        times = {
            "poweroff": poweroff_at,
            "notice_received": received["wall_time"],
            "tainted": first["tainted"]["wall_time"],
            "sigterm_sent": first["sigterm_sent"]["wall_time"],
            "container_exited": first["container_exited"]["wall_time"],
            "verified_empty": first["verified_empty"]["wall_time"],
            "lock_released": released,
            "agent_stopped": agent_stopped,
            "host_down": host_down,
        }
        # Stamped when the test read the job's FIFO line: after the job got the signal, and
        # close to the agent's sigterm_sent (recorded once the engine's kill call returned).
        job_got_sigterm = signals[0].wall if signals else float("nan")
        log.info(
            "poweroff timeline (s after `systemctl poweroff`): %s; the job saw SIGTERM at %.3f",
            {k: round(v - poweroff_at, 3) for k, v in times.items()},
            job_got_sigterm - poweroff_at,
        )

        # The notice: the host's shutdown, D = T0 + the delay logind grants.
        assert (received["action"], received["reason"]) == ("terminate", "notice"), received
        assert received["terminate_at"] == pytest.approx(received["t0"] + LOGIND_DELAY_S, abs=0.5)
        assert received["notice_id"].startswith("shutdown:"), received
        # The drain, in order; the job checkpointed on SIGTERM and exited by itself.
        kinds = [e["kind"] for e in mine]
        for kind in ("tainted", "sigterm_sent", "container_exited", "verified_empty", "drained"):
            assert kind in kinds, kinds
        assert "sigkill_sent" not in kinds and "overrun" not in kinds, kinds
        assert signals and signals[0].text.startswith("TERM"), signals
        assert times["tainted"] < job_got_sigterm < times["container_exited"], times
        assert abs(job_got_sigterm - times["sigterm_sent"]) < 0.5, (job_got_sigterm, times)
        assert (job_state["Status"], job_state["ExitCode"]) == ("exited", 0), job_state
        assert _iso(job_state["FinishedAt"]) < host_down
        order = list(times)
        assert sorted(order, key=times.__getitem__) == order, {
            k: round(v - poweroff_at, 3) for k, v in times.items()
        }
        # Waited for the drain, and not longer: the lock went right after verification, and the
        # host was down within seconds of it, long before logind's 30 s.
        assert times["lock_released"] - times["verified_empty"] < 1.0, times
        assert times["host_down"] - times["lock_released"] < 5.0, times
        assert times["host_down"] - poweroff_at < CHECKPOINT_S + 12.0 < LOGIND_DELAY_S, times
        assert times["container_exited"] - times["sigterm_sent"] >= CHECKPOINT_S - 0.1, times
    finally:
        probe.close()
        coordinator.proc.stop()
        remove_test_containers(client, PREFIX)
