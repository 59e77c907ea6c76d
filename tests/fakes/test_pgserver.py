"""The PostgreSQL test server (tests/fakes/pgserver.py) and the fixtures built on it."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import psycopg
import pytest

from fakes.pgserver import PgServer, database_name, fresh_database, start_postgres

REPO = Path(__file__).resolve().parents[2]


def owners(processes: list[psutil.Process]) -> set[str]:
    """Who runs each process still alive: a backend whose connection just closed may exit
    between the listing and the question."""
    out = set()
    for process in processes:
        try:
            out.add(process.username())
        except psutil.NoSuchProcess:
            continue
    return out


def test_session_server_is_real_postgres_run_by_postgres(postgres: PgServer) -> None:
    assert postgres.url() == f"postgresql://postgres@127.0.0.1:{postgres.port}/postgres"
    with psycopg.connect(postgres.url(), autocommit=True) as conn:
        assert conn.execute("SHOW server_version_num").fetchone()[0].isdigit()
        assert conn.execute("SELECT current_user").fetchone()[0] == "postgres"
        assert conn.execute("SHOW listen_addresses").fetchone()[0] == "127.0.0.1"

    # The postmaster and every backend run as postgres, never root, from outside the checkout.
    postmaster = psutil.Process(postgres.pid)
    assert postmaster.username() == "postgres"
    assert Path(postmaster.exe()).parent == postgres.bin_dir
    assert owners(postmaster.children()) == {"postgres"}
    assert not postgres.root.resolve().is_relative_to(REPO)
    assert postgres.root.stat().st_uid == psutil.Process(postgres.pid).uids().real
    listening = {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.net_connections("inet")
        if c.pid == postgres.pid and c.status == psutil.CONN_LISTEN
    }
    assert listening == {("127.0.0.1", postgres.port)}
    assert "database system is ready to accept connections" in postgres.log()


def test_fresh_databases_are_distinct_and_empty(postgres: PgServer) -> None:
    first = fresh_database(postgres, "Same Prefix!")
    second = fresh_database(postgres, "Same Prefix!")
    assert first != second
    assert database_name(first).startswith("same_prefix_")

    with psycopg.connect(first, autocommit=True) as conn:
        conn.execute("CREATE TABLE nodes (id text PRIMARY KEY, gpus int NOT NULL)")
        conn.execute("INSERT INTO nodes VALUES ('n1', 8), ('n2', 4)")
        assert conn.execute("SELECT sum(gpus) FROM nodes").fetchone()[0] == 12
        assert conn.execute("SELECT current_database()").fetchone()[0] == database_name(first)
    with psycopg.connect(second, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('nodes')").fetchone()[0] is None

    postgres.drop_database(database_name(first))
    with pytest.raises(psycopg.OperationalError, match="does not exist"):
        psycopg.connect(first, connect_timeout=5).close()
    postgres.drop_database(database_name(second))


@pytest.mark.postgres  # starts its own server rather than using the fixture
def test_stop_shuts_down_and_removes_its_directory(tmp_path: Path) -> None:
    server = start_postgres()
    root, pid = server.root, server.pid
    try:
        assert root.is_dir()
        assert (server.data_dir / "PG_VERSION").is_file()
        url = server.create_database("scratch")
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        server.stop()
    assert not root.exists()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not server.running()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(url, connect_timeout=2).close()
    server.stop()  # a second stop is harmless


def test_store_url(store_url: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    marked = request.node.get_closest_marker("postgres") is not None
    if request.node.callspec.params["store_url"] == "sqlite":
        assert store_url == str(tmp_path / "coordinator.sqlite")
        assert not os.path.exists(store_url)
        assert not marked
    else:
        assert store_url.startswith("postgresql://postgres@127.0.0.1:")
        with psycopg.connect(store_url) as conn:
            assert conn.execute("SELECT current_database()").fetchone()[0] == database_name(
                store_url
            )
            assert conn.execute(
                "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
            ).fetchone() == (0,)
        assert marked


def test_coordinator_db(
    coordinator_db: Path | str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    marked = request.node.get_closest_marker("postgres") is not None
    if request.node.callspec.params["coordinator_db"] == "sqlite":
        assert coordinator_db == tmp_path / "coordinator.sqlite"
        assert coordinator_db.parent.is_dir()
        assert not marked
    else:
        assert isinstance(coordinator_db, str)
        with psycopg.connect(coordinator_db) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert marked
