"""A PostgreSQL cluster under Patroni for tests: Debian's `patroni` and `etcd-server`, started by
the tests themselves (tests/setup.sh installs both).

`start_cluster()` starts one etcd and two PostgreSQL instances managed by Patroni, everything on
loopback on free ports, in a fresh directory under /tmp, as the `postgres` user (as
tests/fakes/pgserver.py runs its server), and waits for a primary and a synchronous standby. The
cluster runs in Patroni's synchronous mode, so a commit the coordinator was told of is on the
standby too and a failover loses none of it (asynchronous replication would). The DCS timings
are short (TTL 6 s, loop 1 s) so a dead primary is replaced in seconds. `Cluster.kill_primary()`
SIGKILLs the primary's Patroni and its postmaster: the host gone. `Cluster.stop()` stops
everything and removes the directory.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from fakes.pgserver import HOST, USER, PostgresUnavailable, _postgres_user, server_bin

PATRONI = Path("/usr/bin/patroni")
ETCD = Path("/usr/bin/etcd")
START_TIMEOUT_S = 90.0
# Patroni's DCS timings: loop_wait + 2 * retry_timeout <= ttl.
TTL_S, LOOP_WAIT_S, RETRY_TIMEOUT_S = 6, 1, 2


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Member:
    name: str
    pg_port: int
    rest_port: int
    root: Path
    proc: subprocess.Popen[bytes] | None = None
    killed: bool = False  # by the test: gone on purpose

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def role(self) -> str:
        """What Patroni's REST API says this member is: "primary", "replica" or "" (down)."""
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.rest_port}/patroni", timeout=1) as r:
                doc = json.load(r)
        except (OSError, ValueError):
            return ""
        if doc.get("state") != "running":
            return ""
        return "primary" if doc.get("role") in ("master", "primary") else "replica"

    def sync_standby(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.rest_port}/sync", timeout=1) as r:
                return r.status == 200
        except (OSError, urllib.error.HTTPError):
            return False

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None


class Cluster:
    """One etcd and two Patroni-managed PostgreSQL instances. Use start_cluster()."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin_dir = server_bin()
        self.user = _postgres_user()
        etcd_port, peer_port, *ports = _free_ports(6)
        self.etcd_port, self.etcd_peer_port = etcd_port, peer_port
        self.members = [
            Member("pg1", ports[0], ports[1], root / "pg1"),
            Member("pg2", ports[2], ports[3], root / "pg2"),
        ]
        self.etcd: subprocess.Popen[bytes] | None = None
        self._stopped = False

    # --- what tests use -----------------------------------------------------------------------

    def url(self, dbname: str = "postgres") -> str:
        """A multi-host libpq URI naming both members: the primary is whichever accepts writes."""
        hosts = ",".join(f"{HOST}:{m.pg_port}" for m in self.members)
        return f"postgresql://{USER}@{hosts}/{dbname}?target_session_attrs=read-write"

    def primary(self) -> Member | None:
        return next((m for m in self.members if m.role() == "primary"), None)

    def wait_primary(self, timeout: float = START_TIMEOUT_S, standby: bool = True) -> Member:
        """Until one member is primary (and, with `standby`, the other is its synchronous
        standby, so commits wait for it)."""
        deadline = time.monotonic() + timeout
        while True:
            primary = self.primary()
            others = [m for m in self.members if m is not primary]
            if primary is not None and (not standby or any(m.sync_standby() for m in others)):
                return primary
            for m in self.members:
                if m.proc is not None and m.proc.poll() is not None and not m.killed:
                    raise RuntimeError(
                        f"patroni {m.name} exited {m.proc.returncode}:\n{self.log(m)}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no primary{' and sync standby' if standby else ''} within {timeout} s:\n"
                    + "\n".join(self.log(m)[-3000:] for m in self.members)
                )
            time.sleep(0.2)

    def create_database(self, name: str) -> str:
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def kill_primary(self) -> Member:
        """SIGKILL the primary's Patroni, then its postmaster: the primary host is gone, and
        its leader key in etcd runs out after the TTL; the standby is promoted then."""
        primary = self.primary()
        assert primary is not None, "no primary to kill"
        pid = primary.postmaster_pid()
        assert primary.proc is not None
        primary.killed = True
        primary.proc.kill()
        primary.proc.wait(10)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        return primary

    def log(self, member: Member) -> str:
        try:
            return (member.root / "patroni.log").read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e})"

    def stop(self) -> None:
        """Stop every process (SIGKILL: test data) and remove the directory. Safe twice."""
        if self._stopped:
            return
        self._stopped = True
        for m in self.members:
            pid = m.postmaster_pid()
            if m.proc is not None and m.proc.poll() is None:
                m.proc.kill()
                m.proc.wait(10)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.kill()
            self.etcd.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)

    # --- starting -----------------------------------------------------------------------------

    def _as_postgres(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return subprocess.Popen(
                argv,
                user=self.user.pw_uid,
                group=self.user.pw_gid,
                extra_groups=[],
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": str(self.root)},
                start_new_session=True,
            )

    def _start_etcd(self) -> None:
        client = f"http://{HOST}:{self.etcd_port}"
        peer = f"http://{HOST}:{self.etcd_peer_port}"
        self.etcd = self._as_postgres(
            [
                str(ETCD),
                "--name",
                "e1",
                "--data-dir",
                str(self.root / "etcd"),
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"e1={peer}",
                "--initial-cluster-state",
                "new",
                "--log-level",
                "warn",
            ],
            self.root / "etcd.log",
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if json.load(r).get("health") == "true":
                        return
            except (OSError, ValueError):
                pass
            if self.etcd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start:\n{(self.root / 'etcd.log').read_text()}")
            time.sleep(0.1)

    def _config(self, m: Member) -> dict:
        hba = [
            "local all all trust",
            f"host all all {HOST}/32 trust",
            f"host replication all {HOST}/32 trust",
        ]
        return {
            "scope": f"spotdrain-{self.root.name}",
            "name": m.name,
            "restapi": {
                "listen": f"{HOST}:{m.rest_port}",
                "connect_address": f"{HOST}:{m.rest_port}",
            },
            "etcd3": {"host": f"{HOST}:{self.etcd_port}"},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL_S,
                    "loop_wait": LOOP_WAIT_S,
                    "retry_timeout": RETRY_TIMEOUT_S,
                    "synchronous_mode": True,
                    "postgresql": {
                        "use_pg_rewind": False,
                        "parameters": {
                            "max_connections": 200,
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "max_wal_senders": 5,
                            "max_replication_slots": 5,
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}],
                "pg_hba": hba,
            },
            "postgresql": {
                "listen": f"{HOST}:{m.pg_port}",
                "connect_address": f"{HOST}:{m.pg_port}",
                "data_dir": str(m.data_dir),
                "bin_dir": str(self.bin_dir),
                "pgpass": str(m.root / "pgpass"),
                "authentication": {
                    "superuser": {"username": USER},
                    "replication": {"username": USER},
                },
                "parameters": {"unix_socket_directories": str(m.root)},
                "pg_hba": hba,
            },
        }

    def start(self) -> None:
        for path in (self.root, *(m.root for m in self.members)):
            path.mkdir(exist_ok=True)
            os.chown(path, self.user.pw_uid, self.user.pw_gid)
        self._start_etcd()
        for i, m in enumerate(self.members):
            config = m.root / "patroni.yml"
            config.write_text(json.dumps(self._config(m)))  # JSON is YAML
            os.chown(config, self.user.pw_uid, self.user.pw_gid)
            m.proc = self._as_postgres([str(PATRONI), str(config)], m.root / "patroni.log")
            if i == 0:  # the first bootstraps the cluster; the second then clones it
                self.wait_primary(standby=False)
        self.wait_primary()


def start_cluster() -> Cluster:
    """Start a Patroni cluster; the caller stops it."""
    for binary, package in ((PATRONI, "patroni"), (ETCD, "etcd-server")):
        if not binary.exists():
            raise PostgresUnavailable(
                f"{binary} is missing: Debian's {package} package (tests/setup.sh installs it)"
            )
    root = Path(tempfile.mkdtemp(prefix="spotdrain-patroni-", dir="/tmp"))
    cluster = Cluster(root)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    atexit.register(cluster.stop)
    return cluster
