"""A real PostgreSQL server for tests: Debian's package, started by the tests themselves.

`start_postgres()` runs `initdb` and `postgres` as the `postgres` user (PostgreSQL refuses to run
as root) in a fresh directory under /tmp, which that user can reach wherever the checkout lives
(a mode-0700 home included). The server listens on 127.0.0.1 on a free port, with its unix
socket inside that directory, and trusts local and loopback connections. `PgServer.stop()` shuts
it down fast and removes the directory. tests/setup.sh installs the package.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

SERVER_ROOT = Path("/usr/lib/postgresql")
USER = "postgres"
HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0

_names = itertools.count(1)


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server can be started here (not root, or the package is missing)."""


def server_bin() -> Path:
    """The newest installed server's bin directory (/usr/lib/postgresql/VERSION/bin)."""

    def version(path: Path) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", path.parent.name))

    found = [p for p in SERVER_ROOT.glob("*/bin") if (p / "postgres").is_file()]
    if not found:
        raise PostgresUnavailable(
            f"no PostgreSQL server under {SERVER_ROOT}/*/bin: Debian's postgresql package is "
            "missing (tests/setup.sh installs it)"
        )
    return max(found, key=version)


def _postgres_user() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        raise PostgresUnavailable(
            "the PostgreSQL tests start a server as the postgres user and must run as root "
            "(PostgreSQL itself refuses root; the tests switch to postgres)"
        )
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        raise PostgresUnavailable(
            f"no {USER!r} user: Debian's postgresql package is missing (tests/setup.sh installs it)"
        ) from None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class PgServer:
    """A running postmaster. Use start_postgres() to get one."""

    host = HOST

    def __init__(self, root: Path, bin_dir: Path, user: pwd.struct_passwd) -> None:
        self.root = root  # everything of this server: data, socket, log
        self.data_dir = root / "data"
        self.socket_dir = root / "socket"
        self.log_path = root / "postgres.log"
        self.bin_dir = bin_dir
        self.port = 0
        self._user = user
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopped = False

    # --- what tests use -----------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The postmaster's pid."""
        assert self._proc is not None
        return self._proc.pid

    def url(self, dbname: str = "postgres") -> str:
        """A libpq URI for dbname, as the postgres superuser over loopback TCP."""
        return f"postgresql://{USER}@{self.host}:{self.port}/{dbname}"

    def connect(self, dbname: str = "postgres", **kwargs) -> psycopg.Connection:
        return psycopg.connect(self.url(dbname), connect_timeout=5, **kwargs)

    def create_database(self, name: str) -> str:
        """CREATE DATABASE name; returns its URL."""
        with self.connect(autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """DROP DATABASE name, disconnecting whoever is still connected to it."""
        with self.connect(autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(no server log: {e})"

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """Fast shutdown (SIGINT), then remove the directory. Safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)

    # --- starting -----------------------------------------------------------------------------

    def _run_as_postgres(self, argv: list[str], **kwargs) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv,
            user=self._user.pw_uid,
            group=self._user.pw_gid,
            extra_groups=[],
            cwd=self.root,
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C", "HOME": str(self.root)},
            stdin=subprocess.DEVNULL,
            **kwargs,
        )

    def _initdb(self) -> None:
        argv = [
            str(self.bin_dir / "initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            USER,
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-locale",
            "--no-sync",
        ]
        with open(self.log_path, "ab") as log:
            proc = self._run_as_postgres(argv, stdout=log, stderr=subprocess.STDOUT)
            rc = proc.wait(120)
        if rc != 0:
            raise RuntimeError(f"initdb exited {rc}:\n{self.log()}")

    def _start(self, port: int) -> None:
        self.port = port
        argv = [
            str(self.bin_dir / "postgres"),
            "-D",
            str(self.data_dir),
            "-c",
            f"listen_addresses={HOST}",
            "-p",
            str(port),
            "-c",
            f"unix_socket_directories={self.socket_dir}",
            # Test data: nothing needs to survive a machine crash.
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
            "-c",
            "max_connections=200",
        ]
        with open(self.log_path, "ab") as log:
            self._proc = self._run_as_postgres(argv, stdout=log, stderr=subprocess.STDOUT)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"postgres exited {self._proc.returncode} on port {self.port}:\n{self.log()}"
                )
            try:
                with psycopg.connect(self.url(), connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as e:
                last = e
                time.sleep(0.1)
        raise TimeoutError(
            f"postgres did not accept connections on {self.url()} within {timeout} s "
            f"(last error: {last}):\n{self.log()}"
        )


def start_postgres(work_dir: Path | None = None) -> PgServer:
    """Start a private PostgreSQL server; the caller stops it.

    It lives in a fresh directory made under work_dir (default /tmp), which must be reachable by
    the postgres user: never the checkout, which may sit in a mode-0700 directory.
    """
    user = _postgres_user()
    bin_dir = server_bin()
    root = Path(tempfile.mkdtemp(prefix="spotdrain-pg-", dir=work_dir or "/tmp"))
    server = PgServer(root, bin_dir, user)
    try:
        os.chown(root, user.pw_uid, user.pw_gid)
        server.socket_dir.mkdir(mode=0o700)
        os.chown(server.socket_dir, user.pw_uid, user.pw_gid)
        server._initdb()
        for attempt in range(3):  # the free port can be taken before postgres binds it
            server._start(_free_port())
            try:
                server._wait_ready(START_TIMEOUT_S)
                break
            except RuntimeError:
                if attempt == 2 or "Address already in use" not in server.log():
                    raise
    except BaseException:
        server.stop()
        raise
    atexit.register(server.stop)  # should the session end without tearing down its fixtures
    return server


def fresh_database(server: PgServer, prefix: str = "t") -> str:
    """A new, empty database with a unique name starting with prefix; returns its URL."""
    stem = re.sub(r"[^a-z0-9_]+", "_", prefix.lower()).strip("_")[:40] or "t"
    name = f"{stem}_{os.getpid()}_{next(_names)}_{uuid.uuid4().hex[:6]}"
    return server.create_database(name)


def database_name(url: str) -> str:
    """The database a URL from PgServer.url() names."""
    return url.rsplit("/", 1)[1]
