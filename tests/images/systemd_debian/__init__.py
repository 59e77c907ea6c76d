"""A fresh Debian system with systemd as PID 1, as a container, for installing the packages.

    ensure_systemd_image(client) -> "spotdrain-test/debian-systemd:1"               (Debian 12)
    ensure_systemd_image(client, suite="trixie") -> "spotdrain-test/debian-systemd-trixie:1"
    boot(client, name=..., image=..., mounts=...) -> SystemdContainer   (systemd up, ready for apt)

The image is `debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus,procps bookworm`,
trimmed (apt lists and caches, docs, man pages, locales) and `docker import`ed: no Python, no
spotdrain, so `apt install ./spotdrain-agent_*.deb` has to bring what the packages need. Any
release debootstrap knows (SUITES) is made the same way, from the same mirror. Each trimmed root
is cached as a tarball in /var/cache/spotdrain-test ($SPOTDRAIN_TEST_CACHE), like
the fake model's base (tests/images/fake_model): debootstrap (about 35 s, root, the Debian
mirror) runs once per machine, and a new engine imports the tarball in seconds.

The container runs with exactly the flags docs/design.md gives for systemd in a container
(`--privileged` is refused on this kernel), on the host network (a private engine has no
bridge), so the Debian mirror and anything listening on the host's loopback are reachable from
inside. This module must not import pytest.
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors
import docker.types
from docker.models.containers import Container

from images.fake_model import (
    _digest,
    debootstrap_tarball,
    import_debian_root,
)

log = logging.getLogger("spotdrain.tests.systemd_debian")

SYSTEMD_IMAGE = "spotdrain-test/debian-systemd:1"
SUITE = "bookworm"
# The releases the packaging test installs on: Debian 12 (python3.11) and 13 (python3.13).
SUITES = ("bookworm", "trixie")
RECIPE_LABEL = "spotdrain.test.recipe"

# Bump when the recipe changes in a way the lists below do not show.
_RECIPE = "1"
_INCLUDE = ("systemd", "systemd-sysv", "dbus", "procps")
_TRIM = (
    "var/cache/apt/*",
    "var/lib/apt/lists/*",
    "var/cache/debconf/*-old",
    "var/lib/dpkg/*-old",
    "var/log/*",
    "usr/share/doc/*",
    "usr/share/man/*",
    "usr/share/info/*",
    "usr/share/locale/*",
    "etc/hostname",  # the build host's; Docker mounts its own
)

# docs/design.md, "Testing on machines with no GPU and no registry": systemd in a container.
_RUN_FLAGS = {
    "cap_add": ["SYS_ADMIN"],
    "security_opt": ["seccomp=unconfined"],
    "cgroupns": "host",
    "tmpfs": {"/run": "", "/run/lock": ""},
    "command": ["/lib/systemd/systemd"],
    # systemd shuts down cleanly on SIGRTMIN+3 (docker import cannot set STOPSIGNAL).
    "stop_signal": "SIGRTMIN+3",
}


# ---------------------------------------------------------------------------------------------
# image


def systemd_image(suite: str = SUITE) -> str:
    """The image tag of `suite`'s root (bookworm's keeps the tag it always had)."""
    return SYSTEMD_IMAGE if suite == SUITE else f"spotdrain-test/debian-systemd-{suite}:1"


def ensure_systemd_image(
    client: docker.DockerClient,
    work_dir: Path | None = None,
    *,
    suite: str = SUITE,
    force: bool = False,
) -> str:
    """Import `suite`'s systemd image unless it is there and current. Returns its tag."""
    recipe = _digest(_RECIPE.encode(), suite.encode(), *(s.encode() for s in _INCLUDE + _TRIM))
    return import_debian_root(
        client,
        systemd_image(suite),
        recipe,
        cache_name="debian-systemd",
        build=lambda tarball: _debootstrap_tarball(tarball, work_dir, suite),
        suite=suite,
        # systemd reads `container` to know it runs in a container.
        changes=["ENV container=docker", 'CMD ["/lib/systemd/systemd"]'],
        force=force,
    )


def _debootstrap_tarball(tarball: Path, work_dir: Path | None, suite: str) -> None:
    """debootstrap a minimal Debian root with systemd, trim it, write it to `tarball` atomically."""

    def fresh_machine_id(root: Path) -> None:
        # A fresh id at each boot (systemd makes one when the file is empty), as on a new host.
        (root / "etc/machine-id").write_text("")

    debootstrap_tarball(
        tarball,
        work_dir,
        include=_INCLUDE,
        trim=_TRIM,
        what="systemd",
        customize=fresh_machine_id,
        suite=suite,
    )


# ---------------------------------------------------------------------------------------------
# a booted system


class CommandFailed(RuntimeError):
    """A command inside the container exited non-zero."""


@dataclass
class SystemdContainer:
    """A running Debian container with systemd as PID 1."""

    container: Container

    def sh(
        self, script: str, *, user: str = "root", check: bool = True, env: dict | None = None
    ) -> tuple[int, str]:
        """Run `script` with /bin/sh inside; (exit code, stdout and stderr together)."""
        code, out = self.container.exec_run(
            ["sh", "-c", script], user=user, environment=env or {}, demux=False
        )
        text = (out or b"").decode(errors="replace")
        if check and code != 0:
            raise CommandFailed(f"`{script}` as {user} exited {code}:\n{text}")
        return code, text

    def put(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write `data` to `path` inside (parent directories made as needed)."""
        directory, name = os.path.split(path)
        self.sh(f"mkdir -p '{directory}'")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = mode
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
        if not self.container.put_archive(directory, buf.getvalue()):
            raise CommandFailed(f"could not put {path} into {self.container.name}")

    def remove(self) -> None:
        try:
            self.container.remove(force=True)
        except docker.errors.NotFound:
            pass


def boot(
    client: docker.DockerClient,
    *,
    name: str,
    image: str = SYSTEMD_IMAGE,
    mounts: list[docker.types.Mount] | None = None,
    timeout: float = 60.0,
) -> SystemdContainer:
    """Start the image with systemd as PID 1; return once `systemctl is-system-running` says
    running (or degraded: a unit the container cannot run, listed in the error otherwise)."""
    container = client.containers.run(
        image,
        name=name,
        mounts=[
            docker.types.Mount("/sys/fs/cgroup", "/sys/fs/cgroup", type="bind", read_only=False),
            *(mounts or []),
        ],
        network_mode="host",
        detach=True,
        **_RUN_FLAGS,
    )
    system = SystemdContainer(container)
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        container.reload()
        if container.status != "running":
            logs = container.logs().decode(errors="replace")
            raise CommandFailed(f"{name} exited ({container.status}) while booting:\n{logs}")
        _, state = system.sh("systemctl is-system-running || true")
        state = state.strip()
        if state in ("running", "degraded"):
            if state == "degraded":
                _, failed = system.sh("systemctl --failed --no-legend --plain || true")
                log.warning("%s booted degraded: %s", name, failed.strip())
            return system
        time.sleep(0.2)
    system.remove()
    raise CommandFailed(f"{name}: systemd not up within {timeout}s (state {state!r})")
