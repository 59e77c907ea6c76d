"""An operator installs spotdrain on a fresh Debian 12 or Debian 13 host with
`apt install ./x.deb`, and it works: the packages build with dpkg-buildpackage
(packaging/build-deb.sh), lintian finds nothing, and on a fresh Debian system with systemd as
PID 1 (bookworm, python3.11; trixie, python3.13) postinst makes the venv offline from the
package's wheels on that python3, the agent and coordinator units come up through READY, log to
the journal, answer spotctl for root and the spotdrain group only, remake the venv when python3
is replaced, answer a reclaim notice, survive a restart mid-reclamation with the same deadlines
and without touching the workload, and leave nothing behind on purge. On Debian 12 an upgrade
from the 0.1.0 packages (whose venv was built for python3.11 and shipped) keeps a reclamation
in progress and the configuration.

One module-scoped fixture, parametrized by release, boots the container and installs both
packages (built once, reused while the sources are unchanged: the script keeps a hash of them);
the tests then check each point in order, as an operator would find them. The coordinator is
the packaged one, in the same container; the agent's Docker engine is the test engine, whose
socket is bind-mounted at /run/docker.sock. The container's NVML is the fake library
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
from images.systemd_debian import SUITES, SystemdContainer, boot, ensure_systemd_image
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

log = logging.getLogger("spotdrain.tests.packaging")

REPO = Path(__file__).resolve().parents[2]
BUILD_DEB = REPO / "packaging" / "build-deb.sh"
NODE = f"pkg-node-{os.getpid()}"
PREFIX = f"sdt-pkg-{os.getpid()}-"
FAKE_NVML_DIR = "/usr/local/lib/spotdrain-test"
GPUS_STATE = "/etc/spotdrain-test/gpus.state"
NOTICE_S = 30.0  # D = notice + 30 s, so G = D - 10 s (grace_s) leaves time for a restart
# python3 of each release the host fixture installs on: the venv must be made on it.
PYTHON = {"bookworm": "/usr/bin/python3.11", "trixie": "/usr/bin/python3.13"}
# The last commit whose packages (0.1.0) shipped a venv built for python3.11: the upgrade's start.
OLD_COMMIT = "ef49b3ad14a45b547492e66fc32d6a063a525a5a"


@dataclass(frozen=True)
class Debs:
    agent: Path
    coordinator: Path
    build_s: float


@pytest.fixture(scope="module")
def debs() -> Debs:
    """Both packages, from packaging/build-deb.sh into the test cache (rebuilt only when the
    sources changed)."""
    return _build_debs(BUILD_DEB, cache_dir() / "debs")


@pytest.fixture(scope="module")
def old_debs(tmp_path_factory: pytest.TempPathFactory) -> Debs:
    """The 0.1.0 packages, built by OLD_COMMIT's own build-deb.sh from `git archive` of it
    (cached like the new ones: the script skips a build from the same sources)."""
    src = tmp_path_factory.mktemp("old-src")
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", OLD_COMMIT], capture_output=True, timeout=120
    )
    if archive.returncode != 0:
        pytest.fail(f"git archive {OLD_COMMIT}: {archive.stderr.decode()}", pytrace=False)
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True, timeout=120)
    return _build_debs(src / "packaging" / "build-deb.sh", cache_dir() / "debs-0.1.0")


def _build_debs(script: Path, out: Path) -> Debs:
    started = time.monotonic()
    result = subprocess.run(
        ["bash", str(script), str(out)], capture_output=True, text=True, timeout=900
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

    suite: str
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


@pytest.fixture(scope="module", params=SUITES)
def host(
    request: pytest.FixtureRequest,
    debs: Debs,
    docker_engine: DockerEngine,
    docker_images: dict[str, str],  # the busybox workload image
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Host]:
    """A fresh Debian system of the release `request.param` with systemd, both packages
    installed by apt and configured, both units started."""
    suite = request.param
    timings: dict[str, float] = {"build_debs_s": debs.build_s}
    client = docker_engine.client
    remove_test_containers(client, PREFIX)

    started = time.monotonic()
    image = ensure_systemd_image(client, tmp_path_factory.mktemp("rootfs"), suite=suite)
    timings["image_s"] = time.monotonic() - started

    started = time.monotonic()
    system = boot(
        client, name=f"{PREFIX}{suite}-host", image=image, mounts=_docker_mount(docker_engine)
    )
    timings["boot_s"] = time.monotonic() - started
    try:
        started = time.monotonic()
        before = set(system.sh("dpkg-query -W -f '${Package}\\n'")[1].split())
        _apt_install(system, debs)
        after = set(system.sh("dpkg-query -W -f '${Package}\\n'")[1].split())
        timings["apt_install_s"] = time.monotonic() - started

        started = time.monotonic()
        coordinator = _configure(system, NODE, tmp_path_factory)
        timings["units_up_s"] = time.monotonic() - started

        admin = Admin(pb_grpc.AdminStub(grpc.insecure_channel(coordinator)))
        yield Host(
            suite=suite,
            system=system,
            engine=docker_engine,
            admin=admin,
            coordinator=coordinator,
            installed_by_apt=sorted(after - before),
            timings=timings,
        )
    finally:
        log.info("packaging test timings on %s: %s", suite, timings)
        _log_journal(system)
        remove_test_containers(client, PREFIX)


def _docker_mount(engine: DockerEngine) -> list[docker.types.Mount]:
    """The test engine's socket at the agent's default place."""
    return [docker.types.Mount("/run/docker.sock", _socket_path(engine), type="bind")]


def _apt_install(system: SystemdContainer, debs: Debs) -> None:
    """`apt install ./agent.deb ./coordinator.deb`, as README says (a first install or an
    upgrade). Not in /tmp: Debian 13 mounts a tmpfs there, which Docker's copy does not see."""
    system.put("/var/tmp/debs/" + debs.agent.name, debs.agent.read_bytes())
    system.put("/var/tmp/debs/" + debs.coordinator.name, debs.coordinator.read_bytes())
    system.sh(
        "apt-get update -qq && apt-get install -y -qq --no-install-recommends "
        f"/var/tmp/debs/{debs.agent.name} /var/tmp/debs/{debs.coordinator.name}",
        env={"DEBIAN_FRONTEND": "noninteractive"},
    )


def _configure(
    system: SystemdContainer, node: str, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """The fake GPUs, and the conffiles with README's edits only; restart both units. Returns
    the coordinator's address."""
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
            f'coordinator = "{coordinator}"\nnode_id = "{node}"\ninsecure = true\n' + shipped
        ).encode(),
    )
    system.sh("systemctl daemon-reload")
    system.sh("systemctl restart spotdrain-coordinator")
    system.sh("systemctl restart spotdrain-agent")
    return coordinator


def _log_journal(system: SystemdContainer) -> None:
    """Shown by pytest with a failure: what the daemons said."""
    _, journal = system.sh("journalctl -u 'spotdrain*' --no-pager | tail -n 80", check=False)
    log.info("journal of the spotdrain units, last lines:\n%s", journal)


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


# --- installed on a fresh Debian 12 and a fresh Debian 13 --------------------------------------


@pytest.mark.docker
def test_apt_installs_both_packages_with_their_dependencies(host):
    """`apt install ./spotdrain-agent_*.deb` on a system with no Python brings the release's
    python3 from the mirror; postinst makes the venv on it from the package's wheels (and could
    with no network at all); the configs are conffiles; the spotdrain group and the
    coordinator's user exist."""
    python = PYTHON[host.suite]
    assert {
        "spotdrain-agent",
        "spotdrain-coordinator",
        "python3",
        "python3-venv",
        Path(python).name,
    } <= set(host.installed_by_apt)
    conffiles = host.sh("dpkg-query -W -f '${Conffiles}\\n' spotdrain-agent spotdrain-coordinator")
    assert "/etc/spotdrain/agent.toml" in conffiles
    assert "/etc/spotdrain/coordinator.env" in conffiles
    assert host.sh("getent group spotdrain").startswith("spotdrain:")
    assert host.sh("getent passwd spotdrain-coordinator").startswith("spotdrain-coordinator:")
    # The units' Documentation= is there to read.
    host.sh("test -f /usr/share/doc/spotdrain-agent/README.md")
    host.sh("test -f /usr/share/doc/spotdrain-coordinator/README.md")
    # The venvs run on the system's own interpreter, and hold no installer.
    for prefix in ("/opt/spotdrain", "/opt/spotdrain-coordinator"):
        assert host.sh(f"readlink -f {prefix}/bin/python3").strip() == python
        assert host.system.sh(f"{prefix}/bin/python3 -c 'import pip'", check=False)[0] != 0
    # What postinst runs needs no network: the same, in a network namespace of its own.
    host.sh(
        "unshare --net sh -ec '/usr/lib/spotdrain-agent/venv-from-wheels build /tmp/offline "
        '/usr/lib/spotdrain-agent/wheels && /tmp/offline/bin/python3 -c "import grpc, spotdrain"\''
        " && rm -rf /tmp/offline"
    )
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
def test_a_python3_replaced_under_the_venv_has_it_made_again(host):
    """python3 moving on (a release upgrade: 3.11 -> 3.13) fires the packages' dpkg trigger on
    /usr/bin/python3: a venv no longer on today's python3 is made again and the unit restarted
    on it. Shown by reinstalling python3-minimal (what activates the trigger) after making the
    agent's venv look as if built for another version."""
    python = PYTHON[host.suite]
    version = Path(python).name.removeprefix("python")
    before = host.show("spotdrain-agent", "MainPID")["MainPID"]
    coordinator = host.show("spotdrain-coordinator", "MainPID")["MainPID"]
    host.sh(f"mv /opt/spotdrain/bin/python{version} /opt/spotdrain/bin/python3.10")
    host.sh(
        "apt-get install -y -qq --reinstall python3-minimal",
        env={"DEBIAN_FRONTEND": "noninteractive"},
    )
    assert host.sh(f"readlink -f /opt/spotdrain/bin/python{version}").strip() == python
    host.sh("test ! -e /opt/spotdrain/bin/python3.10")
    props = host.show("spotdrain-agent", "MainPID", "ActiveState", "SubState")
    assert props["MainPID"] != before
    assert (props["ActiveState"], props["SubState"]) == ("active", "running"), props
    # The coordinator's venv was current: left as it was, its unit not restarted.
    assert host.show("spotdrain-coordinator", "MainPID")["MainPID"] == coordinator
    wait_until(lambda: host.status()["node"] == NODE, 20, "spotctl to answer from the remade venv")


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


# --- an upgrade from 0.1.0 on Debian 12 -------------------------------------------------------


@pytest.mark.docker
def test_an_upgrade_from_0_1_0_keeps_a_reclamation_and_the_configuration(
    old_debs: Debs,
    debs: Debs,
    docker_engine: DockerEngine,
    docker_images: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
):
    """`apt install ./new.deb` over the 0.1.0 packages (a venv for python3.11, shipped in the
    package) on Debian 12, mid-reclamation: the edited conffiles are kept as they were (no
    prompt, no .dpkg-dist), the venv is made anew on python3.11 from the wheels, the agent is
    restarted on it and resumes the same reclamation from its bundle (same id, same absolute
    deadlines, the job signalled once), and its state directory keeps every file."""
    client = docker_engine.client
    name = f"{PREFIX}upgrade"
    node = f"{NODE}-up"
    remove_test_containers(client, name)
    image = ensure_systemd_image(client, tmp_path_factory.mktemp("rootfs"), suite="bookworm")
    system = boot(client, name=name, image=image, mounts=_docker_mount(docker_engine))
    timings: dict[str, float] = {"build_old_debs_s": old_debs.build_s}
    try:
        started = time.monotonic()
        _apt_install(system, old_debs)
        timings["old_install_s"] = time.monotonic() - started
        coordinator = _configure(system, node, tmp_path_factory)
        admin = Admin(pb_grpc.AdminStub(grpc.insecure_channel(coordinator)))
        wait_until(lambda: any(n.node_id == node for n in admin.nodes()), 20, f"{node} to register")
        # A reclamation in progress is the state that must survive: a job ignoring SIGTERM and
        # a deadline far enough that the upgrade ends before the grace deadline.
        run_workload(client, name=f"{name}-batch", node_id=node, kind="ignores_term")
        notice_id = f"i-upgrade-{os.getpid()}"
        notice = json.dumps(
            {
                "id": notice_id,
                "action": "terminate",
                "terminate_at": time.time() + 180,
                "source": "test",
            }
        )
        system.sh(
            f"printf '%s' '{notice}' > /run/spotdrain/.notice.tmp && "
            "mv /run/spotdrain/.notice.tmp /run/spotdrain/notice.json"
        )
        received = admin.wait_for("notice_received", node=node, timeout=15, notice_id=notice_id)
        reclaim_id = received["reclaim_id"]
        admin.wait_for("sigterm_sent", node=node, timeout=15, reclaim_id=reclaim_id)
        drain = json.loads(system.sh("spotctl status --json")[1])["drain"]
        conffiles = system.sh("sha256sum /etc/spotdrain/agent.toml /etc/spotdrain/coordinator.env")[
            1
        ]
        state = set(system.sh("find /var/lib/spotdrain -type f")[1].split())
        pid = system.sh("systemctl show -p MainPID --value spotdrain-agent")[1].strip()

        started = time.monotonic()
        _apt_install(system, debs)
        timings["upgrade_s"] = time.monotonic() - started

        versions = system.sh(
            "dpkg-query -W -f '${Package} ${Version} ${db:Status-Abbrev}\\n' "
            "spotdrain-agent spotdrain-coordinator"
        )[1]
        assert versions.split("\n")[:2] == [
            "spotdrain-agent 0.2.0 ii ",
            "spotdrain-coordinator 0.2.0 ii ",
        ], versions
        assert (
            system.sh("sha256sum /etc/spotdrain/agent.toml /etc/spotdrain/coordinator.env")[1]
            == conffiles
        )
        assert system.sh("find /etc/spotdrain -name '*.dpkg-*'")[1] == ""
        assert (
            system.sh("readlink -f /opt/spotdrain/bin/python3")[1].strip() == "/usr/bin/python3.11"
        )
        assert state <= set(system.sh("find /var/lib/spotdrain -type f")[1].split())
        props = system.sh("systemctl show -p MainPID -p ActiveState -p SubState spotdrain-agent")[1]
        assert f"MainPID={pid}\n" not in props and "SubState=running" in props, props
        after = json.loads(system.sh("spotctl status --json")[1])["drain"]
        keys = ("reclaim_id", "terminate_at", "grace_deadline")
        assert {k: after[k] for k in keys} == {k: drain[k] for k in keys}
        assert after["reclaim_id"] == reclaim_id
        kinds = [e["kind"] for e in admin.events(node, reclaim_id)]
        assert kinds.count("sigterm_sent") == 1, kinds
    finally:
        log.info("packaging upgrade timings: %s", timings)
        _log_journal(system)
        remove_test_containers(client, name)
