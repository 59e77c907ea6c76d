"""The Docker test environment: a reachable engine and test images, with no registry.

See "Testing on machines with no GPU and no registry" in docs/design.md. This module is
imported by tests/conftest.py and by the demo, so it must not import pytest.

- `ensure_engine(work_dir)` uses the engine at DOCKER_HOST or /var/run/docker.sock when one
  answers, otherwise starts a private `dockerd` (its own containerd, socket, exec root and pid
  file; a stable data root so imported images are reused across runs).
- `ensure_images(client)` imports `spotdrain-test/busybox:1` from a tarball of busybox-static.
- `workload_command(kind)` / `run_workload(...)` run the drain-relevant workload behaviours:
  `exits_on_term`, `checkpoints`, `ignores_term`.
- `SignalProbe` is the host end of the optional SIGNAL_FIFO probe, for timing SIGTERM delivery.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import io
import json
import logging
import os
import select
import shutil
import signal
import stat
import struct
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import docker
import docker.errors
import docker.types
import psutil
from docker.models.containers import Container
from docker.utils import kwargs_from_env

log = logging.getLogger("spotdrain.tests.dockerenv")

BASE_IMAGE = "spotdrain-test/busybox:1"
WORKLOAD_KINDS = ("exits_on_term", "checkpoints", "ignores_term")
READY_LINE = "spotdrain-workload: ready"

# Images are imported once into this data root and reused by later runs.
DEFAULT_DATA_ROOT = Path("/var/lib/spotdrain-test-docker")
DATA_ROOT_ENV = "SPOTDRAIN_TEST_DOCKER_ROOT"
BUSYBOX_ENV = "SPOTDRAIN_BUSYBOX"
SYSTEM_SOCKET = "/var/run/docker.sock"

# Bump when the tarball layout changes, so a stale image in the stable data root is replaced.
_IMAGE_RECIPE_VERSION = "1"
_RECIPE_LABEL = "spotdrain.test.recipe"
_OWNER_FILE = ".spotdrain-engine.json"
_LOCK_FILE = ".spotdrain-engine.lock"
_SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class EngineError(RuntimeError):
    """No Docker engine could be reached or started."""


# ---------------------------------------------------------------------------------------------
# engine


@dataclass
class DockerEngine:
    """A Docker engine the tests can use. `stop()` stops it only if this process started it."""

    host: str
    client: docker.DockerClient
    owned: bool = False
    data_root: Path | None = None
    work_dir: Path | None = None
    log_path: Path | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    def stop(self, timeout: float = 30.0, *, remove_work_dir: bool = False) -> None:
        """Stop a private engine (containers first, then dockerd and its containerd).

        `remove_work_dir` also deletes the work dir (socket, log), unless something is still
        mounted under it. The data root, with its images, stays.
        """
        if not self.owned or self.process is None:
            self.client.close()
            return
        try:
            # Kill first: dockerd would otherwise give each container its stop grace on shutdown.
            for container in self.client.containers.list():
                try:
                    container.kill()
                except docker.errors.APIError:
                    pass
        except Exception as e:  # the engine may already be gone; stopping must still finish
            log.warning("stop engine %s: could not kill containers: %s", self.host, e)
        self.client.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning(
                    "stop engine %s: dockerd ignored SIGTERM for %ss; killing", self.host, timeout
                )
                self.process.kill()
                self.process.wait(10)
        assert self.work_dir is not None and self.data_root is not None
        _kill_engine_leftovers(self.work_dir / "exec", self.data_root)
        owner = self.data_root / _OWNER_FILE
        try:
            if json.loads(owner.read_text()).get("exec_root") == str(self.work_dir / "exec"):
                owner.unlink()
        except (OSError, ValueError):
            pass
        doomed = self.work_dir if remove_work_dir else self.work_dir / "exec"
        _unmount_under(doomed)  # netns files; a fallback data root's self bind mount
        if _has_mounts_under(doomed):
            log.warning("stop engine %s: mounts remain under %s; leaving it", self.host, doomed)
        else:
            shutil.rmtree(doomed, ignore_errors=True)
        self.process = None


def ensure_engine(
    work_dir: Path,
    *,
    data_root: Path | None = None,
    start_timeout: float = 60.0,
    die_with_parent: bool = True,
) -> DockerEngine:
    """Return an engine that answers: DOCKER_HOST's, the system one, or a private dockerd.

    A private engine keeps its socket, pid file, exec root and log under `work_dir` and its images
    in `data_root` (default /var/lib/spotdrain-test-docker, or $SPOTDRAIN_TEST_DOCKER_ROOT). If
    another live run holds that data root, this one uses `work_dir/data` instead. Containers left
    in the data root by earlier runs are removed, and processes a killed earlier engine left
    there are stopped. With `die_with_parent`, dockerd gets SIGTERM when the calling thread
    exits, so a killed test run leaves no engine behind; without it the engine outlives this
    process (for a demo) and whoever started it must stop it (`kill $(cat work_dir/docker.pid)`).
    """
    external = _external_engine()
    if external is not None:
        return external

    if os.geteuid() != 0:
        raise EngineError(
            "no Docker engine answers (DOCKER_HOST, /var/run/docker.sock) and "
            "starting a private dockerd needs root"
        )
    dockerd = shutil.which("dockerd", path=os.environ.get("PATH", "") + ":" + _SBIN_PATH)
    if dockerd is None:
        raise EngineError(
            "no Docker engine answers and dockerd is not installed "
            "(apt-get install docker.io; see tests/setup.sh)"
        )

    work_dir = Path(work_dir).absolute()
    work_dir.mkdir(parents=True, exist_ok=True)
    socket_path = work_dir / "docker.sock"
    pidfile = work_dir / "docker.pid"
    exec_root = work_dir / "exec"
    log_path = work_dir / "dockerd.log"
    config = work_dir / "daemon.json"
    host = f"unix://{socket_path}"
    if len(str(exec_root / "containerd" / "containerd.sock")) > 100:
        raise EngineError(f"work dir {work_dir} is too long for unix socket paths under it")

    _clear_stale_pidfile(pidfile)
    socket_path.unlink(missing_ok=True)
    config.write_text("{}\n")

    requested_root = Path(data_root or os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
    root, lock_fd = _claim_data_root(
        requested_root.absolute(), fallback=work_dir / "data", exec_root=exec_root
    )

    argv = [
        dockerd,
        f"--data-root={root}",
        f"--host={host}",
        "--iptables=false",
        "--bridge=none",
        "--storage-driver=vfs",
        f"--pidfile={pidfile}",
        # Private state so this engine never meets another dockerd: dockerd starts its own
        # containerd, with its socket and state under the exec root.
        f"--exec-root={exec_root}",
        # An empty config, so a system /etc/docker/daemon.json (hosts, storage) cannot clash.
        f"--config-file={config}",
    ]
    env = dict(os.environ)
    env["PATH"] = env.get("PATH", "") + ":" + _SBIN_PATH
    env.pop("DOCKER_HOST", None)
    parent = os.getpid()

    def _child_setup() -> None:
        if die_with_parent:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:
                os._exit(1)

    started = time.monotonic()
    with open(log_path, "ab") as log_file, _closing_fd(lock_fd):
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            # dockerd (and the containerd it starts) inherits the data-root lock and holds it
            # for as long as it lives.
            pass_fds=(lock_fd,) if lock_fd is not None else (),
            preexec_fn=_child_setup,
        )
    if lock_fd is not None and not die_with_parent:
        # A detached engine outlives this process; while its dockerd lives, it owns the root.
        _write_owner(
            root,
            {
                "pid": process.pid,
                "create_time": psutil.Process(process.pid).create_time(),
                "exec_root": str(exec_root),
            },
        )
    try:
        _wait_until_answers(host, process, log_path, start_timeout)
        client = docker.DockerClient(base_url=host, version="auto", timeout=60)
    except BaseException:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
        _kill_engine_leftovers(exec_root, root)
        raise
    log.info(
        "started dockerd pid %d at %s (data root %s) in %.1fs",
        process.pid,
        host,
        root,
        time.monotonic() - started,
    )

    engine = DockerEngine(
        host=host,
        client=client,
        owned=True,
        data_root=root,
        work_dir=work_dir,
        log_path=log_path,
        process=process,
    )
    for container in client.containers.list(all=True):
        container.remove(force=True)
    return engine


@contextlib.contextmanager
def _closing_fd(fd: int | None):
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def ping(host: str, timeout: float = 2.0, **client_kwargs) -> bool:
    """Whether the engine at `host` answers /_ping within `timeout` seconds."""
    try:
        api = docker.APIClient(base_url=host, version="1.24", timeout=timeout, **client_kwargs)
    except docker.errors.DockerException:
        return False
    try:
        return bool(api.ping())
    except Exception:
        return False
    finally:
        api.close()


def _external_engine() -> DockerEngine | None:
    if os.environ.get("DOCKER_HOST"):
        kwargs = kwargs_from_env()
        host = kwargs.pop("base_url")
        if ping(host, **kwargs):
            client = docker.DockerClient(base_url=host, version="auto", timeout=60, **kwargs)
            return DockerEngine(host=host, client=client)
        log.warning("DOCKER_HOST=%s does not answer; starting a private engine", host)
    if os.path.exists(SYSTEM_SOCKET):
        host = f"unix://{SYSTEM_SOCKET}"
        if ping(host):
            return DockerEngine(
                host=host, client=docker.DockerClient(base_url=host, version="auto", timeout=60)
            )
    return None


def _wait_until_answers(
    host: str, process: subprocess.Popen, log_path: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    socket_path = host.removeprefix("unix://")
    while True:
        if process.poll() is not None:
            raise EngineError(
                f"dockerd exited with code {process.returncode} before answering "
                f"at {host}; log {log_path}:\n{_tail(log_path)}"
            )
        if os.path.exists(socket_path) and ping(host, timeout=1.0):
            return
        if time.monotonic() > deadline:
            raise EngineError(
                f"dockerd did not answer at {host} within {timeout:.0f}s; "
                f"log {log_path}:\n{_tail(log_path)}"
            )
        time.sleep(0.1)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def _clear_stale_pidfile(pidfile: Path) -> None:
    """dockerd refuses to start while its pid file names a live process; clear a dead run's."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        pidfile.unlink(missing_ok=True)
        return
    try:
        proc = psutil.Process(pid)
        if any(str(pidfile) in arg for arg in proc.cmdline()):
            log.warning("stopping dockerd pid %d left running by an earlier run", pid)
            _terminate([proc])
    except psutil.Error:
        pass
    pidfile.unlink(missing_ok=True)


def _claim_data_root(root: Path, fallback: Path, exec_root: Path) -> tuple[Path, int | None]:
    """Lock `root` for one engine. Returns the data root to use and the lock's fd.

    The lock is a flock that dockerd inherits, so it is held exactly while the engine lives.
    The owner record beside it names the run that holds it: a live owner means a concurrent run
    (use `fallback`); a dead one means a leftover engine, which is stopped.
    """
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        log.warning("data root %s unusable (%s); using %s", root, e, fallback)
        return fallback, None
    first_dead_owner_seen = None
    deadline = time.monotonic() + 30
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        else:
            # No engine lives on this root now, so whatever still runs from one is an orphan
            # (a shim and its container outlive a dockerd that was SIGKILLed).
            owner = _read_owner(root)
            _kill_engine_leftovers(Path(owner["exec_root"]) if owner else None, root)
            me = psutil.Process()
            _write_owner(
                root,
                {"pid": me.pid, "create_time": me.create_time(), "exec_root": str(exec_root)},
            )
            return root, fd
        owner = _read_owner(root)
        if owner is not None and _owner_alive(owner):
            log.warning(
                "data root %s is in use by the engine of live pid %s; using %s",
                root,
                owner.get("pid"),
                fallback,
            )
            os.close(fd)
            return fallback, None
        now = time.monotonic()
        if first_dead_owner_seen is None:
            first_dead_owner_seen = now  # the holder may be writing its record right now
        elif now - first_dead_owner_seen > 1.0:
            log.warning("data root %s is held by a leftover engine (%s); stopping it", root, owner)
            _kill_engine_leftovers(Path(owner["exec_root"]) if owner else None, root)
            first_dead_owner_seen = None
        if now > deadline:
            log.warning("data root %s is still locked; using %s", root, fallback)
            os.close(fd)
            return fallback, None
        time.sleep(0.2)


def _read_owner(root: Path) -> dict | None:
    try:
        return json.loads((root / _OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None


def _write_owner(root: Path, owner: dict) -> None:
    tmp = root / (_OWNER_FILE + ".tmp")
    tmp.write_text(json.dumps(owner))
    tmp.rename(root / _OWNER_FILE)


def _owner_alive(owner: dict) -> bool:
    """The run that owns the engine is alive (a detached engine owns itself: its dockerd)."""
    try:
        proc = psutil.Process(int(owner["pid"]))
        return abs(proc.create_time() - float(owner["create_time"])) < 1.0
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def _kill_engine_leftovers(exec_root: Path | None, data_root: Path) -> None:
    """Stop the processes of one private engine: its dockerd, containerd and shims (found by
    the engine's own paths on their command lines) and any container process still running."""
    ours: list[psutil.Process] = []
    container_ids = set()
    containers_dir = data_root / "containers"
    if containers_dir.is_dir():
        container_ids = {p.name for p in containers_dir.iterdir() if len(p.name) == 64}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            argv = proc.info["cmdline"] or []
            if _mentions_engine(argv, exec_root, data_root) or container_ids.intersection(argv):
                ours.append(proc)  # dockerd, containerd, or a shim (`-id <container id>`)
                continue
            if container_ids:
                cgroup = Path(f"/proc/{proc.pid}/cgroup").read_text()
                if any(cid in cgroup for cid in container_ids):
                    ours.append(proc)
        except (psutil.Error, OSError):
            continue
    if ours:
        log.warning("stopping %d process(es) left by an engine on %s", len(ours), data_root)
        _terminate(ours, timeout=3.0)
    if exec_root is not None:
        _unmount_under(exec_root)  # network namespaces a killed dockerd left bind-mounted


def _mentions_engine(argv: list[str], exec_root: Path | None, data_root: Path) -> bool:
    """A dockerd on `data_root`, or anything (containerd, shims) naming a path in `exec_root`."""
    pairs = zip(argv, argv[1:], strict=False)
    if any(pair == ("--data-root", str(data_root)) for pair in pairs):
        return True
    if f"--data-root={data_root}" in argv:
        return True
    if exec_root is None:
        return False
    inside = str(exec_root) + "/"
    return any(arg == str(exec_root) or inside in arg for arg in argv)


def _terminate(procs: list[psutil.Process], timeout: float = 10.0) -> None:
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path) + "/"
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    return [p for p in points if p.startswith(prefix)]


def _unmount_under(path: Path) -> None:
    try:
        points = _mounts_under(path)
    except OSError:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for point in sorted(points, key=len, reverse=True):
        if libc.umount2(point.encode(), 2) != 0:  # MNT_DETACH
            log.warning("could not unmount %s: %s", point, os.strerror(ctypes.get_errno()))


def _has_mounts_under(path: Path) -> bool:
    try:
        return bool(_mounts_under(path))
    except OSError:
        return True


# ---------------------------------------------------------------------------------------------
# images


def ensure_images(client: docker.DockerClient) -> dict[str, str]:
    """Import the base image if it is missing or stale. Returns image names by role.

    Keys: "base", and each workload kind (all the base image today: the behaviour lives in the
    command, see `workload_command`).
    """
    busybox = find_busybox()
    payload = busybox.read_bytes()
    applets = _busybox_applets(busybox)
    recipe = hashlib.sha256(
        b"\0".join([_IMAGE_RECIPE_VERSION.encode(), payload, *map(str.encode, applets)])
    ).hexdigest()[:16]
    try:
        image = client.images.get(BASE_IMAGE)
        current = (image.labels or {}).get(_RECIPE_LABEL)
    except docker.errors.ImageNotFound:
        current = None
    if current != recipe:
        started = time.monotonic()
        client.api.import_image_from_data(
            _rootfs_tar(payload, applets),
            repository=BASE_IMAGE.split(":")[0],
            tag=BASE_IMAGE.split(":")[1],
            changes=[
                "ENV PATH=/usr/sbin:/usr/bin:/sbin:/bin",
                'CMD ["sh"]',
                f"LABEL {_RECIPE_LABEL}={recipe}",
            ],
        )
        image = client.images.get(BASE_IMAGE)
        if (image.labels or {}).get(_RECIPE_LABEL) != recipe:
            raise EngineError(f"imported {BASE_IMAGE} but the engine dropped its label")
        log.info("imported %s in %.1fs", BASE_IMAGE, time.monotonic() - started)
    return {"base": BASE_IMAGE, **{kind: BASE_IMAGE for kind in WORKLOAD_KINDS}}


def find_busybox() -> Path:
    """The statically linked busybox to put in images ($SPOTDRAIN_BUSYBOX, else /bin/busybox)."""
    candidates = [
        os.environ.get(BUSYBOX_ENV),
        "/bin/busybox",
        "/usr/bin/busybox",
        shutil.which("busybox"),
    ]
    for candidate in filter(None, candidates):
        path = Path(candidate)
        if path.is_file():
            if not _is_static_elf(path):
                raise EngineError(
                    f"{path} is dynamically linked; the test image needs "
                    "busybox-static (apt-get install busybox-static)"
                )
            return path
    raise EngineError("busybox not found; apt-get install busybox-static")


def _is_static_elf(path: Path) -> bool:
    """True for an ELF with no PT_INTERP program header (no dynamic loader)."""
    with open(path, "rb") as f:
        header = f.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2:  # 64-bit only
            return False
        endian = "<" if header[5] == 1 else ">"
        (phoff,) = struct.unpack_from(endian + "Q", header, 0x20)
        phentsize, phnum = struct.unpack_from(endian + "HH", header, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    return all(
        struct.unpack_from(endian + "I", table, i * phentsize)[0] != 3  # PT_INTERP
        for i in range(phnum)
    )


def _busybox_applets(busybox: Path) -> list[str]:
    out = subprocess.run(
        [str(busybox), "--list-full"], check=True, capture_output=True, text=True, timeout=10
    ).stdout
    return sorted({line.strip().lstrip("/") for line in out.splitlines() if line.strip()})


def _rootfs_tar(busybox: bytes, applets: list[str]) -> bytes:
    """A minimal root file system: /bin/busybox, a link per applet, /etc/passwd, /tmp."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        dirs = {
            "bin",
            "sbin",
            "usr",
            "usr/bin",
            "usr/sbin",
            "etc",
            "dev",
            "proc",
            "sys",
            "run",
            "root",
            "home",
            "var",
            "tmp",
            "var/tmp",
        }
        for applet in applets:
            parent = os.path.dirname(applet)
            while parent:
                dirs.add(parent)
                parent = os.path.dirname(parent)
        for name in sorted(dirs):
            info = tarfile.TarInfo(name)
            info.type = tarfile.DIRTYPE
            info.mode = {"tmp": 0o1777, "var/tmp": 0o1777, "root": 0o700}.get(name, 0o755)
            tar.addfile(info)

        def add_file(name: str, data: bytes, mode: int) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = mode
            tar.addfile(info, io.BytesIO(data))

        add_file("bin/busybox", busybox, 0o755)
        add_file(
            "etc/passwd",
            b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
            0o644,
        )
        add_file("etc/group", b"root:x:0:\nnogroup:x:65534:\n", 0o644)
        for applet in applets:
            if applet == "bin/busybox":
                continue
            info = tarfile.TarInfo(applet)
            info.type = tarfile.SYMTYPE
            info.linkname = "/bin/busybox"
            info.mode = 0o777
            tar.addfile(info)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# workloads

# The workload shell runs as PID 1: the kernel drops signals PID 1 has no handler for, so TERM
# is trapped explicitly. `sleep & wait` keeps the shell in `wait`, which a trapped signal
# interrupts at once (a foreground `sleep` would delay the trap until it ends).
_PRELUDE = r"""
probe() {
  if [ -n "$SIGNAL_FIFO" ] && [ -e "$SIGNAL_FIFO" ]; then
    echo "$1 ${SPOTDRAIN_PROBE_ID:-$HOSTNAME}" >> "$SIGNAL_FIFO"
  fi
}
"""

_LOOP = r"""
echo "spotdrain-workload: ready"
while :; do sleep 3600 & wait $!; done
"""

_SCRIPTS = {
    "exits_on_term": r"""
trap 'probe TERM; echo "spotdrain-workload: SIGTERM, exiting"; exit 0' TERM
""",
    # The deadline file may be written just after the signal (DESIGN step 4), so it is looked
    # for throughout the checkpoint, and printed once when it appears. A second TERM does not
    # restart the checkpoint.
    "checkpoints": r"""
: "${CHECKPOINT_S:=%(checkpoint_s)s}"
on_term() {
  probe TERM
  if [ -n "$ck" ]; then
    echo "spotdrain-workload: SIGTERM again, still checkpointing"
    return
  fi
  echo "spotdrain-workload: SIGTERM, checkpointing for ${CHECKPOINT_S}s"
  sleep "$CHECKPOINT_S" & ck=$!
  shown=
  while kill -0 "$ck" 2>/dev/null; do
    f="$SPOTDRAIN_DEADLINE_FILE"
    if [ -z "$shown" ] && [ -n "$f" ] && [ -s "$f" ]; then
      echo "spotdrain-workload: deadline file: $(cat "$f")"
      shown=1
    fi
    sleep 0.1
  done
  echo "spotdrain-workload: checkpoint done"
  exit 0
}
trap on_term TERM
""",
    "ignores_term": r"""
trap 'probe TERM; echo "spotdrain-workload: SIGTERM ignored"; kill $! 2>/dev/null' TERM
""",
}

_OPTIONS = {"exits_on_term": {}, "checkpoints": {"checkpoint_s": 3}, "ignores_term": {}}


def workload_command(kind: str, **opts) -> list[str]:
    """The `["sh", "-c", script]` command for a workload behaviour.

    kinds:
      exits_on_term  traps TERM and exits 0 at once.
      checkpoints    traps TERM, "checkpoints" for $CHECKPOINT_S seconds (default: opt
                     `checkpoint_s`, else 3), printing $SPOTDRAIN_DEADLINE_FILE's content if it
                     appears meanwhile, then exits 0. Further TERMs do not restart it.
      ignores_term   traps TERM and carries on; only SIGKILL ends it (exit code 137).
    Every kind prints READY_LINE once its trap is set. With $SIGNAL_FIFO naming a file or FIFO,
    the trap first appends "TERM <$SPOTDRAIN_PROBE_ID or hostname>" to it (see SignalProbe).
    """
    if kind not in _SCRIPTS:
        raise ValueError(f"unknown workload kind {kind!r}; expected one of {WORKLOAD_KINDS}")
    unknown = set(opts) - set(_OPTIONS[kind])
    if unknown:
        raise TypeError(f"workload {kind!r} takes no option(s) {sorted(unknown)}")
    values = {**_OPTIONS[kind], **opts}
    if "checkpoint_s" in values and not float(values["checkpoint_s"]) >= 0:
        raise ValueError(f"checkpoint_s must be a number of seconds >= 0, not {opts}")
    script = _SCRIPTS[kind] % values if values else _SCRIPTS[kind]
    return ["sh", "-c", _PRELUDE + script + _LOOP]


def run_workload(
    client: docker.DockerClient,
    *,
    name: str,
    node_id: str,
    kind: str,
    image: str = BASE_IMAGE,
    drain_kind: str = "batch",
    labels: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    mounts: list[docker.types.Mount] | None = None,
    ready_timeout: float | None = 10.0,
) -> Container:
    """Start a detached workload container with behaviour `kind` (see `workload_command`).

    Labels: spotdrain.node=<node_id>, spotdrain.kind=<drain_kind> (the drain path: batch,
    inference, rental, render), plus spotdrain.test.behaviour=<kind>; `labels` override them.
    Returns once the workload has set its TERM trap (unless ready_timeout is None): a TERM sent
    before that would be dropped by the kernel, since the shell is PID 1.
    """
    command = workload_command(kind)
    all_labels = {
        "spotdrain.node": node_id,
        "spotdrain.kind": drain_kind,
        "spotdrain.test.behaviour": kind,
        **(labels or {}),
    }
    container = client.containers.run(
        image,
        command,
        name=name,
        labels=all_labels,
        environment=env or {},
        mounts=mounts or [],
        network_mode="none",
        detach=True,
        auto_remove=False,
    )
    if ready_timeout is not None:
        wait_ready(container, ready_timeout)
    return container


def wait_ready(container: Container, timeout: float = 10.0) -> None:
    """Wait until the workload prints READY_LINE; raise if it exits or takes too long."""
    deadline = time.monotonic() + timeout
    while True:
        if READY_LINE.encode() in container.logs():
            return
        container.reload()
        if container.status not in ("created", "running"):
            raise RuntimeError(
                f"workload {container.name} ended ({container.status}) before "
                f"it was ready: {container.logs().decode(errors='replace')}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"workload {container.name} not ready in {timeout}s: "
                f"{container.logs().decode(errors='replace')}"
            )
        time.sleep(0.05)


def remove_test_containers(client: docker.DockerClient, prefix: str) -> int:
    """Force-remove every container whose name starts with `prefix`. Returns how many."""
    removed = 0
    for container in client.containers.list(all=True, sparse=True):
        name = (container.attrs.get("Names") or [""])[0].lstrip("/")
        if name.startswith(prefix):
            try:
                client.api.remove_container(container.id, force=True)
                removed += 1
            except docker.errors.NotFound:
                pass
    return removed


# ---------------------------------------------------------------------------------------------
# signal probe


@dataclass(frozen=True)
class ProbeLine:
    """One line from the probe FIFO, stamped when the host read it."""

    text: str
    monotonic: float
    wall: float


class SignalProbe:
    """The host end of the SIGNAL_FIFO probe: a FIFO in `directory`, bind-mounted into workloads.

    The FIFO is held open read-write, so a workload's write never blocks on a missing reader and
    `read()` never sees end-of-file. Lines are stamped when `read()` gets them: to time delivery,
    be blocked in `read()` (e.g. in a thread) when the signal goes out.

        probe = SignalProbe(tmp_path / "probe")
        run_workload(..., env=probe.env, mounts=[probe.mount])
    """

    CONTAINER_DIR = "/spotdrain-probe"
    FIFO_NAME = "signals.fifo"

    def __init__(self, directory: Path):
        self.directory = Path(directory).absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / self.FIFO_NAME
        if not (self.path.exists() and stat.S_ISFIFO(self.path.stat().st_mode)):
            self.path.unlink(missing_ok=True)
            os.mkfifo(self.path, 0o666)
        self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._buffer = b""

    @property
    def mount(self) -> docker.types.Mount:
        return docker.types.Mount(
            target=self.CONTAINER_DIR, source=str(self.directory), type="bind"
        )

    @property
    def env(self) -> dict[str, str]:
        return {"SIGNAL_FIFO": f"{self.CONTAINER_DIR}/{self.FIFO_NAME}"}

    def read(self, timeout: float) -> ProbeLine:
        """The next line; TimeoutError if none arrives within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line on {self.path} within {timeout}s")
            ready, _, _ = select.select([self._fd], [], [], left)
            if ready:
                self._buffer += os.read(self._fd, 4096)
        now_mono, now_wall = time.monotonic(), time.time()
        line, self._buffer = self._buffer.split(b"\n", 1)
        return ProbeLine(line.decode(errors="replace"), now_mono, now_wall)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SignalProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


RENTAL_IMAGE = "spotdrain-test/rental:1"
# The renter's program. Its behaviour comes from its id (RENTAL_ID, or WORKER_ID for a job),
# since a rental carries no command: "exits-7" ends by itself with code 7, "ignores-term" only
# dies by SIGKILL, anything else exits 3 on SIGTERM.
RENTAL_SCRIPT = r"""
id="$RENTAL_ID$WORKER_ID"
trap 'exit 3' TERM
case "$id" in
  *exits-7*) sleep 0.5; exit 7 ;;
  *ignores-term*) trap '' TERM ;;
esac
while :; do sleep 3600 & wait $!; done
"""


def ensure_rental_image(client: docker.DockerClient, base: str) -> str:
    """A renter's image: busybox with RENTAL_SCRIPT as its command, rebuilt when the recipe
    (the base image and the script) changes."""
    recipe = hashlib.sha256((client.images.get(base).id + RENTAL_SCRIPT).encode()).hexdigest()[:16]
    with contextlib.suppress(docker.errors.ImageNotFound):
        if (client.images.get(RENTAL_IMAGE).labels or {}).get(_RECIPE_LABEL) == recipe:
            return RENTAL_IMAGE
    builder = client.containers.create(base, command=["true"], network_mode="none")
    try:
        repository, tag = RENTAL_IMAGE.split(":")
        builder.commit(
            repository,
            tag,
            changes=[
                f"CMD {json.dumps(['sh', '-c', RENTAL_SCRIPT])}",
                f"LABEL {_RECIPE_LABEL}={recipe}",
            ],
            pause=False,
        )
    finally:
        builder.remove(force=True)
    return RENTAL_IMAGE
