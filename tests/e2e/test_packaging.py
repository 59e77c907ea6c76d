"""An operator installs spotdrain on a fresh Debian 12 host with `apt install ./x.deb`, and it
works: the packages build with dpkg-buildpackage (packaging/build-deb.sh), lintian finds
nothing, and on a fresh Debian 12 system with systemd as PID 1 the agent and coordinator units
come up through READY, log to the journal, answer spotctl for root and the spotdrain group only,
answer a reclaim notice, survive a restart mid-reclamation with the same deadlines and without
touching the workload, and leave nothing behind on purge.

One module-scoped fixture builds the packages (reused while the sources are unchanged: the
script keeps a hash of them), boots the container and installs both packages; the tests then
check each point in order, as an operator would find them. The coordinator is the packaged one,
in the same container; the agent's Docker engine is the test engine, whose socket is
bind-mounted at /run/docker.sock. The container's NVML is the fake library
(tests/fakes/fakenvml), set for the agent by a systemd drop-in, as an operator would set any
environment.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import docker.types
import grpc
import pytest

from fakes.dockerenv import DockerEngine, remove_test_containers, run_workload
from fakes.fakenvml import LIB_NAME, build
from fakes.harness import Admin
from fakes.waiting import wait_until
from images.fake_model import cache_dir
from images.systemd_debian import SystemdContainer, boot, ensure_systemd_image
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

log = logging.getLogger("spotdrain.tests.packaging")

REPO = Path(__file__).resolve().parents[2]
BUILD_DEB = REPO / "packaging" / "build-deb.sh"
NODE = f"pkg-node-{os.getpid()}"
PREFIX = f"sdt-pkg-{os.getpid()}-"
FAKE_NVML_DIR = "/usr/local/lib/spotdrain-test"
GPUS_STATE = "/etc/spotdrain-test/gpus.state"
NOTICE_S = 30.0  # D = notice + 30 s, so G = D - 10 s (grace_s) leaves time for a restart


@dataclass(frozen=True)
class Debs:
    agent: Path
    coordinator: Path
    build_s: float


@pytest.fixture(scope="module")
def debs() -> Debs:
    """Both packages, from packaging/build-deb.sh into the test cache (rebuilt only when the
    sources changed)."""
    out = cache_dir() / "debs"
    started = time.monotonic()
    result = subprocess.run(
        ["bash", str(BUILD_DEB), str(out)], capture_output=True, text=True, timeout=900
    )
    if result.returncode != 0:
        pytest.fail(f"build-deb.sh failed ({result.returncode}):\n{result.stderr}", pytrace=False)
    paths = [Path(p) for p in result.stdout.split()]
    agent = next(p for p in paths if p.name.startswith("spotdrain-agent_"))
    coordinator = next(p for p in paths if p.name.startswith("spotdrain-coordinator_"))
    return Debs(agent, coordinator, time.monotonic() - started)


@dataclass
class Host:
    """The installed Debian system, and what the tests learn from it in order."""

    system: SystemdContainer
    engine: DockerEngine
    admin: Admin
    coordinator: str
    installed_by_apt: list[str]
    timings: dict[str, float] = field(default_factory=dict)
    reclaim_id: str = ""
    deadlines: dict[str, float] = field(default_factory=dict)

    def sh(self, script: str, **kw) -> str:
        return self.system.sh(script, **kw)[1]

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.sh(f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def status(self) -> dict:
        return json.loads(self.sh("spotctl status --json"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _socket_path(engine: DockerEngine) -> str:
    if not engine.host.startswith("unix://"):
        pytest.fail(f"the packaging test bind-mounts a unix socket; engine is {engine.host}")
    return engine.host.removeprefix("unix://")


@pytest.fixture(scope="module")
def host(
    debs: Debs,
    docker_engine: DockerEngine,
    docker_images: dict[str, str],  # the busybox workload image
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Host]:
    """A fresh Debian 12 with systemd, both packages installed by apt and configured, both
    units started."""
    timings: dict[str, float] = {"build_debs_s": debs.build_s}
    client = docker_engine.client
    remove_test_containers(client, PREFIX)

    started = time.monotonic()
    image = ensure_systemd_image(client, tmp_path_factory.mktemp("rootfs"))
    timings["image_s"] = time.monotonic() - started

    started = time.monotonic()
    system = boot(
        client,
        name=PREFIX + "host",
        image=image,
        mounts=[docker.types.Mount("/run/docker.sock", _socket_path(docker_engine), type="bind")],
    )
    timings["boot_s"] = time.monotonic() - started
    try:
        started = time.monotonic()
        system.put("/tmp/debs/" + debs.agent.name, debs.agent.read_bytes())
        system.put("/tmp/debs/" + debs.coordinator.name, debs.coordinator.read_bytes())
        before = set(system.sh("dpkg-query -W -f '${Package}\\n'")[1].split())
        system.sh(
            "apt-get update -qq && apt-get install -y -qq --no-install-recommends "
            f"/tmp/debs/{debs.agent.name} /tmp/debs/{debs.coordinator.name}",
            env={"DEBIAN_FRONTEND": "noninteractive"},
        )
        after = set(system.sh("dpkg-query -W -f '${Package}\\n'")[1].split())
        timings["apt_install_s"] = time.monotonic() - started

        # The test's own pieces: fake GPUs for the agent, through a drop-in.
        lib = build(tmp_path_factory.mktemp("nvml")) / LIB_NAME
        system.put(f"{FAKE_NVML_DIR}/{LIB_NAME}", lib.read_bytes(), 0o755)
        system.put(GPUS_STATE, b"gpus 1\n")
        system.put(
            "/etc/systemd/system/spotdrain-agent.service.d/fake-nvml.conf",
            f"[Service]\nEnvironment=LD_LIBRARY_PATH={FAKE_NVML_DIR} "
            f"FAKE_NVML_STATE={GPUS_STATE}\n".encode(),
        )
        # The operator's configuration: the conffiles, edited.
        port = _free_port()
        coordinator = f"127.0.0.1:{port}"
        system.put(
            "/etc/spotdrain/coordinator.env",
            f'SPOTDRAIN_COORDINATOR_LISTEN={coordinator}\nSPOTDRAIN_COORDINATOR_OPTS="--insecure"\n'.encode(),
        )
        # The shipped agent.toml with only README's edits ("coordinator, node_id" and the
        # identity: insecure here, TLS files on a real host): the paths are the defaults.
        _, shipped = system.sh("cat /etc/spotdrain/agent.toml")
        system.put(
            "/etc/spotdrain/agent.toml",
            (
                f'coordinator = "{coordinator}"\nnode_id = "{NODE}"\ninsecure = true\n' + shipped
            ).encode(),
        )
        started = time.monotonic()
        system.sh("systemctl daemon-reload")
        system.sh("systemctl restart spotdrain-coordinator")
        system.sh("systemctl restart spotdrain-agent")
        timings["units_up_s"] = time.monotonic() - started

        admin = Admin(pb_grpc.AdminStub(grpc.insecure_channel(coordinator)))
        yield Host(
            system=system,
            engine=docker_engine,
            admin=admin,
            coordinator=coordinator,
            installed_by_apt=sorted(after - before),
            timings=timings,
        )
    finally:
        log.info("packaging test timings: %s", timings)
        # Shown by pytest with a failure: what the daemons said.
        _, journal = system.sh("journalctl -u 'spotdrain*' --no-pager | tail -n 80", check=False)
        log.info("journal of the spotdrain units, last lines:\n%s", journal)
        remove_test_containers(client, PREFIX)


# --- the packages, before any install ---------------------------------------------------------


def test_lintian_finds_no_error_and_no_warning(debs):
    """lintian on both packages: no error and no warning. What the packages do on purpose
    (a venv in /opt, its interpreter in the scripts' shebangs, grpcio's own zlib) is overridden
    with the reason, in packaging/debian/*.lintian-overrides."""
    lintian = shutil.which("lintian")
    if lintian is None:
        pytest.fail("lintian not found: apt-get install lintian (tests/setup.sh)", pytrace=False)
    result = subprocess.run(
        [lintian, "--fail-on", "error,warning", str(debs.agent), str(debs.coordinator)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    tags = [line for line in result.stdout.splitlines() if re.match(r"[EW]: ", line)]
    assert (tags, result.returncode) == ([], 0), result.stdout + result.stderr


# --- installed on a fresh Debian 12 -----------------------------------------------------------


@pytest.mark.docker
def test_apt_installs_both_packages_with_their_dependencies(host):
    """`apt install ./spotdrain-agent_*.deb` on a system with no Python brings python3.11 from
    the mirror; the configs are conffiles; the spotdrain group and the coordinator's user exist."""
    assert {"spotdrain-agent", "spotdrain-coordinator", "python3", "python3.11"} <= set(
        host.installed_by_apt
    )
    conffiles = host.sh("dpkg-query -W -f '${Conffiles}\\n' spotdrain-agent spotdrain-coordinator")
    assert "/etc/spotdrain/agent.toml" in conffiles
    assert "/etc/spotdrain/coordinator.env" in conffiles
    assert host.sh("getent group spotdrain").startswith("spotdrain:")
    assert host.sh("getent passwd spotdrain-coordinator").startswith("spotdrain-coordinator:")
    # The units' Documentation= is there to read.
    host.sh("test -f /usr/share/doc/spotdrain-agent/README.md")
    host.sh("test -f /usr/share/doc/spotdrain-coordinator/README.md")
    # The venv runs on the system's own interpreter.
    assert host.sh("readlink -f /opt/spotdrain/bin/python3").strip() == "/usr/bin/python3.11"
    # The units as installed, ExecStart included, are what `systemd-analyze verify` accepts
    # silently (tests/repository/test_units.py checks them from the source tree with a stub
    # program).
    code, said = host.system.sh(
        "systemd-analyze verify --man=no spotdrain-agent.service spotdrain-coordinator.service",
        check=False,
    )
    assert (code, said) == (0, "")


@pytest.mark.docker
def test_units_reach_active_running_through_ready(host):
    """Type=notify: `active (running)` only once the daemon said READY=1; its STATUS= line is
    shown; the watchdog is armed."""
    for unit in ("spotdrain-coordinator", "spotdrain-agent"):
        props = host.show(
            unit, "Type", "ActiveState", "SubState", "StatusText", "WatchdogUSec", "NRestarts"
        )
        assert props["Type"] == "notify", props
        assert (props["ActiveState"], props["SubState"]) == ("active", "running"), props
        assert props["StatusText"], f"{unit} sent no STATUS= line: {props}"
        assert props["WatchdogUSec"] == "30s", props
        assert props["NRestarts"] == "0", props
    # And the agent is really at work: registered with the packaged coordinator.
    wait_until(
        lambda: any(n.node_id == NODE for n in host.admin.nodes()),
        20,
        f"{NODE} to register with the packaged coordinator",
    )


@pytest.mark.docker
def test_journal_has_structured_entries_with_the_node_id(host):
    """journalctl -u spotdrain-agent: entries sent through journald's native protocol, with
    the NODE_ID field an operator filters on (journalctl NODE_ID=...)."""
    entries = _journal(host, "spotdrain-agent")
    mine = [e for e in entries if e.get("NODE_ID") == NODE]
    assert mine, f"no entry with NODE_ID={NODE} among {len(entries)}"
    assert all(e.get("_TRANSPORT") == "journal" for e in mine)
    assert {"PRIORITY", "LOGGER", "CODE_FILE"} <= set(mine[0]), mine[0]


@pytest.mark.docker
def test_spotctl_status_answers_root_and_the_spotdrain_group_only(host):
    """The owner's socket is root's and group spotdrain's: alice (in the group) gets the status,
    bob (not in it) is refused by the agent."""
    host.sh("useradd -m -G spotdrain alice && useradd -m bob")
    for user in ("root", "alice"):
        code, out = host.system.sh("spotctl status --json", user=user, check=False)
        assert code == 0, f"{user}: {out}"
        assert json.loads(out)["node"] == NODE
    code, out = host.system.sh("spotctl status", user="bob", check=False)
    assert code != 0
    assert "permission denied (root or group spotdrain only)" in out


@pytest.mark.docker
def test_a_notice_written_on_the_host_is_answered(host):
    """The provider's relay writes the notice file (atomically, by rename) on a node running a
    batch job that ignores SIGTERM: the agent taints the node and signals the job, and the
    coordinator records it all."""
    run_workload(host.engine.client, name=PREFIX + "batch", node_id=NODE, kind="ignores_term")
    terminate_at = time.time() + NOTICE_S
    notice_id = f"i-pkg-{os.getpid()}"
    notice = json.dumps(
        {"id": notice_id, "action": "terminate", "terminate_at": terminate_at, "source": "test"}
    )
    host.sh(
        f"printf '%s' '{notice}' > /run/spotdrain/.notice.tmp && "
        "mv /run/spotdrain/.notice.tmp /run/spotdrain/notice.json"
    )
    received = host.admin.wait_for("notice_received", node=NODE, timeout=15, notice_id=notice_id)
    host.reclaim_id = received["reclaim_id"]
    host.admin.wait_for("sigterm_sent", node=NODE, timeout=15, reclaim_id=host.reclaim_id)
    kinds = [e["kind"] for e in host.admin.events(NODE, host.reclaim_id)]
    # The node's events in the order it made them; the coordinator's own reactions to the
    # Taint (replacement_unavailable) may be stored before the node's first batch arrives.
    node_kinds = [k for k in kinds if k in ("notice_received", "tainted", "sigterm_sent")]
    assert node_kinds[:1] == ["notice_received"] and "tainted" in node_kinds, kinds
    assert node_kinds.index("tainted") < node_kinds.index("sigterm_sent"), kinds
    drain = host.status()["drain"]
    assert drain["reclaim_id"] == host.reclaim_id
    assert drain["terminate_at"] == pytest.approx(terminate_at, abs=1e-3)
    host.deadlines = {k: drain[k] for k in ("terminate_at", "grace_deadline")}


@pytest.mark.docker
def test_restart_mid_reclamation_keeps_deadlines_and_leaves_the_workload_alone(host):
    """`systemctl restart spotdrain-agent` while the job is draining: a new agent process
    comes up through READY, reloads the bundle with the same absolute deadlines (invariant 2),
    and neither stops nor signals the job again (KillMode=process; the job is Docker's)."""
    assert host.reclaim_id, "runs after the notice test"
    workload = host.engine.client.containers.get(PREFIX + "batch")
    before = host.show("spotdrain-agent", "MainPID")["MainPID"]
    started = time.monotonic()
    host.sh("systemctl restart spotdrain-agent")
    restart_s = time.monotonic() - started
    props = host.show("spotdrain-agent", "MainPID", "ActiveState", "SubState")
    assert props["MainPID"] != before
    # The old agent must exit on SIGTERM, not wait for systemd's SIGKILL (TimeoutStopSec=10s).
    stop_timed_out = "State 'stop-sigterm' timed out" in host.sh(
        "journalctl -u spotdrain-agent --no-pager -n 30"
    )
    assert (stop_timed_out, restart_s < 5) == (False, True), f"restart took {restart_s:.1f} s"
    assert (props["ActiveState"], props["SubState"]) == ("active", "running")

    drain = host.status()["drain"]
    assert drain["reclaim_id"] == host.reclaim_id
    assert {k: drain[k] for k in host.deadlines} == host.deadlines
    time.sleep(2.0)  # room for a wrongly repeated SIGTERM to land
    workload.reload()
    assert workload.status == "running"
    assert workload.logs().decode().count("SIGTERM ignored") == 1
    assert [e["kind"] for e in host.admin.events(NODE, host.reclaim_id)].count("sigterm_sent") == 1


@pytest.mark.docker
def test_the_reclamation_ends_drained_at_the_coordinator(host):
    """At the grace deadline the agent kills the job, verifies the node empty (Docker and the
    fake NVML) and the coordinator records `drained` for this node, before D."""
    assert host.reclaim_id, "runs after the notice test"
    left = host.deadlines["terminate_at"] - time.time()
    drained = host.admin.wait_for(
        "drained", node=NODE, timeout=max(left, 0) + 10, reclaim_id=host.reclaim_id
    )
    assert drained["wall_time"] < host.deadlines["terminate_at"], drained
    kinds = [e["kind"] for e in host.admin.events(NODE, host.reclaim_id)]
    assert "sigkill_sent" in kinds and "overrun" not in kinds, kinds
    workload = host.engine.client.containers.get(PREFIX + "batch")
    assert workload.wait(timeout=10)["StatusCode"] == 137  # SIGKILLed at G, as it ignores TERM


@pytest.mark.docker
def test_journal_entries_carry_the_reclamation_id(host):
    """The drain's log lines are findable with journalctl RECLAIM_ID=<id>."""
    assert host.reclaim_id, "runs after the notice test"
    entries = _journal(host, "spotdrain-agent", f"RECLAIM_ID={host.reclaim_id}")
    assert entries and all(e.get("NODE_ID") == NODE for e in entries), entries[:3]


@pytest.mark.docker
def test_purge_leaves_no_process_no_unit_and_no_state(host):
    """`apt purge` stops the daemons and removes the units, the venvs, the conffiles and the
    state; nothing of spotdrain keeps running."""
    host.sh(
        "apt-get purge -y -qq spotdrain-agent spotdrain-coordinator",
        env={"DEBIAN_FRONTEND": "noninteractive"},
    )
    # (list-unit-files exits 1 when nothing matches)
    units = host.sh("systemctl list-units --all --plain --no-legend 'spotdrain*' || true")
    files = host.sh("systemctl list-unit-files --plain --no-legend 'spotdrain*' || true")
    processes = [
        line
        for line in host.sh("ps -eo pid=,args=").splitlines()
        if "spotdrain" in line and "ps -eo" not in line
    ]
    left = host.sh(
        "for p in /opt/spotdrain /opt/spotdrain-coordinator /etc/spotdrain /var/lib/spotdrain "
        "/var/lib/spotdrain-coordinator /run/spotdrain /usr/bin/spotctl; do "
        '[ -e "$p" ] && echo "$p"; done; true'
    )
    assert (units.strip(), files.strip(), processes, left.split()) == ("", "", [], [])


def _journal(host: Host, unit: str, *matches: str) -> list[dict]:
    out = host.sh(f"journalctl -u {unit} -o json --no-pager {' '.join(matches)}")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]
