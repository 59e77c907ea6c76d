"""The systemd units an operator installs with the packages (packaging/systemd/) are valid, keep
the settings the agent's promises rest on, and stay hardened. Fast: no Docker, no systemd
running; only `systemd-analyze` (Debian's systemd package; tests/setup.sh installs it).

`systemd-analyze verify` also checks that ExecStart's program exists and is executable, and the
packages' programs live in /opt only once installed. So each unit is verified as shipped except
for that one path: it is copied to a temp dir with ExecStart's program (not its arguments)
pointed at a stub script there. `--root=` is no way out: it resolves every unit the verified
one pulls in (sysinit.target, docker.service, ...) under that root too.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from spotdrain.agent.core.reclamation import Margins

UNITS = Path(__file__).resolve().parents[2] / "packaging" / "systemd"
AGENT = UNITS / "spotdrain-agent.service"
COORDINATOR = UNITS / "spotdrain-coordinator.service"
PROGRAMS = {
    AGENT.name: "/opt/spotdrain/bin/spotdrain-agent",
    COORDINATOR.name: "/opt/spotdrain-coordinator/bin/spotdrain-coordinator",
}
# `systemd-analyze security --offline` exposure, 0 (locked down) to 10. The agent is root with
# the Docker socket, CAP_KILL and /dev/nvidia* by design; these catch hardening that is lost.
MAX_EXPOSURE = {AGENT.name: 3.5, COORDINATOR.name: 2.0}


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail(
            "systemd-analyze not found: apt-get install systemd (tests/setup.sh)", pytrace=False
        )
    return found


def settings(unit: Path) -> dict[str, list[str]]:
    """`Section.Key` -> values, in order (systemd keys may repeat); comments dropped."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def stubbed_copy(unit: Path, directory: Path, text: str | None = None) -> Path:
    """`unit` in `directory`, its ExecStart program replaced by an executable stub there."""
    stub = directory / "program"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    text = unit.read_text() if text is None else text
    program = PROGRAMS[unit.name]
    assert f"ExecStart={program} " in text, f"{unit.name}: ExecStart is not {program}"
    copy = directory / unit.name
    copy.write_text(text.replace(f"ExecStart={program} ", f"ExecStart={stub} "))
    return copy


def verify(unit: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [systemd_analyze(), "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=unit.parent,
    )


@pytest.mark.parametrize("unit", [AGENT, COORDINATOR], ids=lambda u: u.name)
def test_systemd_analyze_verify_finds_nothing_to_say(unit, tmp_path):
    """An operator's `systemd-analyze verify` on the shipped unit prints nothing: no unknown key,
    no bad value, no missing dependency."""
    result = verify(stubbed_copy(unit, tmp_path))
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_verify_would_catch_a_mistake(tmp_path):
    """The check above is not vacuous: a misspelt key and a bad value are reported (on
    stderr, with exit 0, which is why the check wants silence and not only exit 0)."""
    text = AGENT.read_text().replace("Type=notify", "Typ=notify")
    text = text.replace("WatchdogSec=30s", "WatchdogSec=thirty")
    result = verify(stubbed_copy(AGENT, tmp_path, text))
    said = result.stdout + result.stderr
    assert "Unknown key 'Typ'" in said and "Failed to parse sec value, ignoring: thirty" in said


@pytest.mark.parametrize("unit", [AGENT, COORDINATOR], ids=lambda u: u.name)
def test_hardening_exposure_stays_low(unit, tmp_path):
    """`systemd-analyze security` scores the sandbox; losing a hardening line raises it."""
    result = subprocess.run(
        [
            systemd_analyze(),
            "security",
            "--offline=true",
            "--no-pager",
            str(stubbed_copy(unit, tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE[unit.name], result.stdout


def test_agent_unit_keeps_what_the_promises_rest_on():
    """The agent's unit: READY through sd_notify, a watchdog, restarts that resume drains and
    never stop workloads, Docker wanted but not required, and a sandbox that still lets a root
    daemon signal any host PID and open /dev/nvidia*."""
    s = settings(AGENT)
    expected = {
        "Unit.Wants": ["docker.service", "network-online.target"],
        "Unit.After": ["docker.service", "network-online.target"],
        "Service.Type": ["notify"],
        "Service.NotifyAccess": ["main"],
        "Service.ExecStart": [
            "/opt/spotdrain/bin/spotdrain-agent --config /etc/spotdrain/agent.toml"
        ],
        "Service.WatchdogSec": ["30s"],
        "Service.Restart": ["on-failure"],
        "Service.KillMode": ["process"],
        "Service.RuntimeDirectory": ["spotdrain"],
        "Service.RuntimeDirectoryPreserve": ["yes"],
        "Service.StateDirectory": ["spotdrain"],
        "Service.ProtectSystem": ["strict"],
        "Service.ReadWritePaths": ["/var/lib/spotdrain /run/spotdrain"],
        "Service.ProtectHome": ["yes"],
        "Service.NoNewPrivileges": ["yes"],
        "Service.PrivateTmp": ["yes"],
        "Service.ProtectKernelTunables": ["yes"],
        "Service.ProtectControlGroups": ["yes"],
        "Service.RestrictSUIDSGID": ["yes"],
        "Service.LockPersonality": ["yes"],
        "Install.WantedBy": ["multi-user.target"],
    }
    assert {key: s.get(key) for key in expected} == expected
    # Docker restarting must not take the agent down with it.
    assert not {"Unit.Requires", "Unit.BindsTo", "Unit.PartOf", "Unit.Requisite"} & set(s)
    # Signalling container PIDs as root, and NVML's device nodes.
    forbidden = {
        "Service.PrivatePIDs",
        "Service.PrivateUsers",
        "Service.PrivateDevices",
        "Service.DevicePolicy",
        "Service.DeviceAllow",
        "Service.ProtectClock",
        "Service.User",
        "Service.DynamicUser",
        "Service.PrivateNetwork",
    }
    assert not forbidden & set(s)
    assert "CAP_KILL" in s["Service.CapabilityBoundingSet"][0].split()


def test_coordinator_unit_keeps_what_the_promises_rest_on():
    """The coordinator's unit: READY through sd_notify, a watchdog, its own unprivileged user,
    options from the conffile, the store in its StateDirectory unless the conffile names a
    PostgreSQL database, no capabilities."""
    s = settings(COORDINATOR)
    expected = {
        "Service.Type": ["notify"],
        "Service.NotifyAccess": ["main"],
        "Service.EnvironmentFile": ["-/etc/spotdrain/coordinator.env"],
        "Service.ExecStart": [
            "/opt/spotdrain-coordinator/bin/spotdrain-coordinator "
            "--listen ${SPOTDRAIN_COORDINATOR_LISTEN} "
            "--db ${SPOTDRAIN_COORDINATOR_DB} $SPOTDRAIN_COORDINATOR_OPTS"
        ],
        "Service.Environment": [
            "SPOTDRAIN_COORDINATOR_LISTEN=0.0.0.0:7443",
            "SPOTDRAIN_COORDINATOR_DB=%S/spotdrain-coordinator/coordinator.sqlite",
        ],
        "Service.WatchdogSec": ["30s"],
        "Service.Restart": ["on-failure"],
        "Service.User": ["spotdrain-coordinator"],
        "Service.StateDirectory": ["spotdrain-coordinator"],
        "Service.ProtectSystem": ["strict"],
        "Service.ReadWritePaths": ["/var/lib/spotdrain-coordinator"],
        "Service.NoNewPrivileges": ["yes"],
        "Service.CapabilityBoundingSet": [""],
        "Install.WantedBy": ["multi-user.target"],
    }
    assert {key: s.get(key) for key in expected} == expected


@pytest.mark.parametrize("unit", [AGENT, COORDINATOR], ids=lambda u: u.name)
def test_every_setting_says_why(unit):
    """Each [Service] setting sits under a comment that explains it (docs/contributing.md:
    comments say why): no directive follows a blank line or a section header directly."""
    lines = unit.read_text().splitlines()
    section = ""
    bare = []
    for i, line in enumerate(lines):
        if line.startswith("["):
            section = line
            continue
        if section != "[Service]" or not line or line.startswith("#"):
            continue
        previous = lines[i - 1]
        if not previous or previous.startswith("["):
            bare.append(line)
    assert bare == []


LOGIND_DROP_IN = UNITS / "logind.conf.d" / "spotdrain-agent.conf"


def test_the_logind_drop_in_gives_a_shutdown_room_to_drain():
    """The agent package's logind drop-in sets InhibitDelayMaxSec, nothing else: a shutdown's
    D = T0 + that delay, so under the default margins a workload still has time between its
    SIGTERM at T0 and the grace deadline G, and the agent between G and the overrun check O.
    The package installs it where logind reads drop-ins (logind's own default of 5 s would put
    G before T0)."""
    s = settings(LOGIND_DROP_IN)
    assert list(s) == ["Login.InhibitDelayMaxSec"], s
    delay = float(s["Login.InhibitDelayMaxSec"][0])
    margins = Margins()
    assert delay - margins.grace_s >= 15, "workloads get under 15 s to checkpoint"
    assert margins.grace_s - margins.overrun_s >= 5, "no room to kill and verify"
    install = (UNITS.parent / "debian" / "spotdrain-agent.install").read_text().split("\n")
    shipped = "packaging/systemd/logind.conf.d/spotdrain-agent.conf usr/lib/systemd/logind.conf.d/"
    assert shipped in install
