"""A real Slurm cluster for tests: Debian's slurm-wlm 22.05 and munge, started by the tests.

`start_cluster()` makes a fresh directory under /tmp (the checkout may sit in a mode-0700 home)
holding everything: a munge key and a private `munged` on its own socket, a slurm.conf that points
Slurm's auth at that socket (`AuthInfo=socket=`), one `slurmctld` and three `slurmd` (sd-n1..3)
on 127.0.0.1 with distinct ports, and fake GPUs as character devices for gres. Daemons run in the
foreground as children, under their real names (argv[0] picks what a Slurm binary is), and are
stopped by pid. `SlurmCluster.stop()` ends them all and removes the directory; atexit does too.
tests/setup.sh installs the packages.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from fakes.slurm_conf import GPUS_PER_NODE, KILL_WAIT_S, NODES, write_conf
from fakes.waiting import wait_until

BIN_DIR = Path("/usr/bin")
SBIN_DIR = Path("/usr/sbin")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
MUNGE_USER = "munge"
# No driver answers at this major: nothing opens the devices, gres only needs them to exist.
GPU_MAJOR = 195


class SlurmUnavailable(RuntimeError):
    """No Slurm cluster can be started here (not root, or a package is missing)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_installed() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        raise SlurmUnavailable("the Slurm tests start slurmd, which must run as root")
    wanted = [SBIN_DIR / "slurmctld", SBIN_DIR / "slurmd", SBIN_DIR / "munged"]
    wanted += [BIN_DIR / name for name in ("sbatch", "scontrol", "squeue", "sinfo", "scancel")]
    missing = [str(p) for p in wanted if not p.exists()]
    if missing:
        raise SlurmUnavailable(
            f"missing {', '.join(missing)}: Debian's slurmctld, slurmd, slurm-client and munge "
            "packages (tests/setup.sh installs them)"
        )
    try:
        return pwd.getpwnam(MUNGE_USER)
    except KeyError:
        raise SlurmUnavailable(f"no {MUNGE_USER!r} user: the munge package is missing") from None


class SlurmCluster:
    """A running cluster. Use start_cluster() to get one."""

    bin_dir = BIN_DIR
    nodes = NODES
    kill_wait_s = KILL_WAIT_S

    def __init__(self, root: Path, munge_user: pwd.struct_passwd) -> None:
        self.root = root
        self.conf = root / "etc" / "slurm.conf"
        self.log_dir = root / "log"
        self.munge_socket = root / "munge" / "munge.socket"
        self.host = socket.gethostname().split(".")[0]
        self._munge_user = munge_user
        self._munged: subprocess.Popen[bytes] | None = None
        self._slurmctld: subprocess.Popen[bytes] | None = None
        self._slurmd: dict[str, subprocess.Popen[bytes]] = {}
        self._stopped = False

    # --- what tests use -----------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm's CLI: this cluster's slurm.conf."""
        return {"PATH": f"{BIN_DIR}:/usr/sbin:/bin", "LC_ALL": "C", "SLURM_CONF": str(self.conf)}

    def cli(self, *argv: str, timeout: float = 15.0, check: bool = True) -> str:
        """Run a Slurm command (scontrol, squeue...) against this cluster; its stdout."""
        proc = subprocess.run(
            [str(BIN_DIR / argv[0]), *argv[1:]],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def submit(
        self,
        script: str,
        node: str | None,
        *,
        requeue: bool = False,
        name: str = "t",
        args: Iterable[str] = (),
    ) -> int:
        """sbatch script (a shell script's text) on node (`-w`: the job stays bound to it, even
        requeued), or wherever Slurm places it when node is None; the job id."""
        fd, name_ = tempfile.mkstemp(prefix="job-", suffix=".sh", dir=self.root / "jobs")
        os.close(fd)
        path = Path(name_)
        path.write_text(script if script.startswith("#!") else "#!/bin/bash\n" + script)
        jobs = self.root / "jobs"
        out = self.cli(
            "sbatch",
            "--parsable",
            f"--job-name={name}",
            *([f"--nodelist={node}"] if node else []),
            "--requeue" if requeue else "--no-requeue",
            f"--chdir={jobs}",
            f"--output={jobs}/%j.out",
            "--open-mode=append",  # a requeued job's second run adds to its first run's output
            *args,
            str(path),
        )
        return int(out.strip().split(";")[0])

    def job_field(self, job_id: int, field: str) -> str | None:
        """One field of `scontrol -o show job`; None when the controller no longer knows it."""
        proc = subprocess.run(
            [str(BIN_DIR / "scontrol"), "-o", "show", "job", str(job_id)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=15,
        )
        for token in proc.stdout.split():
            key, _, value = token.partition("=")
            if key == field:
                return value
        return None

    def wait_state(self, job_id: int, states: Iterable[str], timeout: float = 30.0) -> str:
        """Wait until the job's JobState is one of states; that state."""
        wanted = set(states)

        def state() -> str | None:
            found = self.job_field(job_id, "JobState")
            return found if found in wanted else None

        return wait_until(state, timeout, f"job {job_id} in {sorted(wanted)}", every=0.1)

    def output(self, job_id: int) -> str:
        try:
            return (self.root / "jobs" / f"{job_id}.out").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def node_state(self, node: str) -> str:
        return self.cli("sinfo", "-h", "-n", node, "-o", "%T").strip()

    def reset(self) -> None:
        """Put the cluster back as a test found it: controller running, no jobs, no drain."""
        if self._slurmctld is None:
            self.start_controller()
        else:
            self.thaw_controller()
        self.cli("scancel", "--user=root")
        self._wait(lambda: not self.cli("squeue", "-h").strip(), "no jobs left")
        for node in NODES:
            if "drain" in self.node_state(node):
                self.cli("scontrol", "update", f"NodeName={node}", "State=RESUME")
        self._wait(self._all_idle, "three idle nodes in sinfo")

    @property
    def controller_pid(self) -> int:
        assert self._slurmctld is not None
        return self._slurmctld.pid

    def slurmd_pid(self, node: str) -> int:
        return self._slurmd[node].pid

    def stop_controller(self) -> None:
        """SIGTERM slurmctld and wait for it to exit (its state is saved in the temp dir)."""
        if self._slurmctld is not None:
            self.thaw_controller()  # a frozen process never sees SIGTERM
            _terminate(self._slurmctld)
            self._slurmctld = None

    def start_controller(self) -> None:
        """Start slurmctld again; returns once it answers `scontrol ping`."""
        assert self._slurmctld is None, "slurmctld is running"
        self._slurmctld = self._daemon("slurmctld", ["-D", "-f", str(self.conf)], "slurmctld")
        self._wait(self._controller_up, "slurmctld to answer ping")

    def freeze_controller(self) -> None:
        os.kill(self.controller_pid, signal.SIGSTOP)

    def thaw_controller(self) -> None:
        if self._slurmctld is not None and self._slurmctld.poll() is None:
            os.kill(self._slurmctld.pid, signal.SIGCONT)

    def log(self, name: str) -> str:
        """A daemon's log: 'slurmctld', 'munged' or a node name."""
        if name == "munged":
            path = self.log_dir / "munged.stdout"  # in the foreground it logs to stderr only
        else:
            path = self.log_dir / (f"slurmd-{name}.log" if name in NODES else f"{name}.log")
        try:
            return path.read_text(errors="replace")[-4000:]
        except OSError as e:
            return f"(no log: {e})"

    def stop(self) -> None:
        """Stop every daemon by pid, then remove the directory. Safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        self.thaw_controller()  # a frozen controller never sees SIGTERM
        procs = [*self._slurmd.values(), self._slurmctld, self._munged]
        for proc in procs:
            if proc is not None:
                _terminate(proc)
        _kill_tree_under(self.root)
        shutil.rmtree(self.root, ignore_errors=True)

    # --- starting -----------------------------------------------------------------------------

    def _daemon(self, name: str, args: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(self.log_dir / f"{log}.stdout", "ab") as out:
            return subprocess.Popen(
                [name, *args],
                executable=str(SBIN_DIR / name),
                env={**self.env, "HOME": str(self.root)},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                start_new_session=True,
            )

    def _layout(self) -> dict[str, int]:
        for sub in ("etc", "log", "state", "spool", "run", "jobs", "dev"):
            (self.root / sub).mkdir()
        munge_dir = self.munge_socket.parent
        munge_dir.mkdir(mode=0o755)
        uid, gid = self._munge_user.pw_uid, self._munge_user.pw_gid
        os.chown(munge_dir, uid, gid)
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        os.chown(key, uid, gid)
        for node in NODES:
            for i in range(GPUS_PER_NODE):
                minor = NODES.index(node) * GPUS_PER_NODE + i
                dev = self.root / "dev" / f"{node}-gpu{i}"
                os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(GPU_MAJOR, minor))
        return {"ctld": _free_port(), **{node: _free_port() for node in NODES}}

    def _start_munged(self) -> None:
        d = self.munge_socket.parent
        argv = [
            "munged",
            "--foreground",
            f"--socket={self.munge_socket}",
            f"--key-file={d / 'munge.key'}",
            f"--pid-file={d / 'munged.pid'}",
            f"--log-file={d / 'munged.log'}",
            f"--seed-file={d / 'munged.seed'}",
        ]
        with open(self.log_dir / "munged.stdout", "ab") as out:
            self._munged = subprocess.Popen(
                argv,
                executable=str(SBIN_DIR / "munged"),
                user=self._munge_user.pw_uid,
                group=self._munge_user.pw_gid,
                extra_groups=[],
                env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=d,
                start_new_session=True,
            )
        self._wait(self.munge_socket.exists, "munged's socket", self._munged)

    def _controller_up(self) -> bool:
        out = subprocess.run(
            [str(BIN_DIR / "scontrol"), "ping"], env=self.env, capture_output=True, text=True
        ).stdout
        return "is UP" in out

    def _all_idle(self) -> bool:
        out = self.cli("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
        return all(states.get(node) == "idle" for node in NODES)

    def _wait(
        self,
        ready,
        what: str,
        proc: subprocess.Popen[bytes] | None = None,
        timeout: float = START_TIMEOUT_S,
    ) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p for p in (proc, self._munged, self._slurmctld, *self._slurmd.values()) if p]
            exited = [p.args[0] for p in dead if p.poll() is not None]
            if exited or time.monotonic() > deadline:
                why = f"{', '.join(exited)} exited" if exited else f"not within {timeout} s"
                logs = "\n".join(
                    f"--- {n}:\n{self.log(n)}" for n in ("munged", "slurmctld", *NODES)
                )
                raise RuntimeError(f"waiting for {what}: {why}\n{logs}")
            time.sleep(0.1)

    def _start(self) -> None:
        write_conf(self.conf.parent, self.root, self.host, self._layout(), self.munge_socket)
        self._start_munged()
        self.start_controller()
        for node in NODES:
            self._slurmd[node] = self._daemon(
                "slurmd", ["-D", "-N", node, "-f", str(self.conf)], f"slurmd-{node}"
            )
        self._wait(self._all_idle, "three idle nodes in sinfo")


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # Its own session: slurmctld's slurmscriptd goes with it.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(STOP_TIMEOUT_S)


def _kill_tree_under(root: Path) -> None:
    """SIGKILL what jobs left behind: slurmstepd outlives slurmd, and it and its jobs keep the
    cluster's directory as their cwd; their descendants go too, wherever they moved."""
    parents: dict[int, int] = {}
    seeds: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            parents[pid] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if os.readlink(entry / "cwd").startswith(str(root)):
                seeds.add(pid)
        except (OSError, ValueError, IndexError):
            continue
    doomed = set(seeds)
    while grown := {p for p, parent in parents.items() if parent in doomed} - doomed:
        doomed |= grown
    for pid in doomed - {os.getpid()}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start_cluster() -> SlurmCluster:
    """Start a private Slurm cluster with its own munged; the caller stops it."""
    munge_user = _check_installed()
    for attempt in range(3):  # a free port can be taken before a daemon binds it
        root = Path(tempfile.mkdtemp(prefix="spotdrain-slurm-", dir="/tmp"))
        os.chmod(root, 0o755)
        cluster = SlurmCluster(root, munge_user)
        try:
            cluster._start()
            break
        except RuntimeError as e:
            cluster.stop()
            if attempt == 2 or "Address already in use" not in str(e):
                raise
        except BaseException:
            cluster.stop()
            raise
    atexit.register(cluster.stop)  # should the session end without tearing down its fixtures
    return cluster
