"""Shared fixtures. The Docker engine and test images come from tests/fakes/dockerenv.py, the
PostgreSQL server from tests/fakes/pgserver.py, the Slurm cluster from tests/fakes/slurm.py."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from fakes.dockerenv import (
    DockerEngine,
    ensure_engine,
    ensure_images,
    ensure_rental_image,
    remove_test_containers,
)
from fakes.fakenvml import FakeGpus, build
from fakes.harness import start_coordinator
from fakes.pgserver import PgServer, database_name, fresh_database, start_postgres
from fakes.pki import Pki
from fakes.slurm import SlurmCluster, start_cluster

# The two store backends every store-level and end-to-end test runs against.
STORE_BACKENDS = ["sqlite", "postgresql"]


def _no_docker(what: str, error: BaseException) -> NoReturn:
    # Never a skip: Docker-backed tests must run, in CI above all (docs/design.md).
    where = (
        "CI must run the Docker-backed tests"
        if os.environ.get("CI") == "true"
        else "Docker-backed tests need an engine; tests/setup.sh installs one"
    )
    raise pytest.fail.Exception(f"{what}: {error}\n({where})", pytrace=False) from None


def _no_postgres(error: BaseException) -> NoReturn:
    # Never a skip, as for Docker: PostgreSQL-backed tests must run, in CI above all.
    where = (
        "CI must run the PostgreSQL-backed tests"
        if os.environ.get("CI") == "true"
        else "PostgreSQL-backed tests need Debian's postgresql package; tests/setup.sh installs it"
    )
    raise pytest.fail.Exception(
        f"could not start PostgreSQL: {error}\n({where})", pytrace=False
    ) from None


def _uses_postgres(item: pytest.Item) -> bool:
    if "postgres" in getattr(item, "fixturenames", ()):
        return True
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    return any(params.get(name) == "postgresql" for name in ("store_url", "coordinator_db"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The `postgres`, `browser` and `slurm` markers are what .ci/docker_guard.py counts: such
    # tests must run in CI.
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)
        if _uses_postgres(item):
            item.add_marker(pytest.mark.postgres)
        if "browser" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.browser)


# --- a browser: Debian's chromium driven by Playwright, never a downloaded one ------------------

CHROMIUM = Path("/usr/bin/chromium")


def _no_browser(error: BaseException | str) -> NoReturn:
    # Never a skip, as for Docker: the dashboard's browser test must run, in CI above all.
    where = (
        "CI must run the browser-backed tests"
        if os.environ.get("CI") == "true"
        else "browser-backed tests need Debian's chromium and the test extra's playwright; "
        "tests/setup.sh installs both"
    )
    raise pytest.fail.Exception(f"no browser: {error}\n({where})", pytrace=False) from None


@pytest.fixture(scope="module")
def browser():
    """Headless chromium (Debian's, through Playwright's executable_path), for one module.
    Not the session: Playwright's sync API keeps an event loop running on the main thread
    while it is open, and every asyncio test after it would fail to start its own."""
    try:
        from playwright.sync_api import sync_playwright  # noqa: PLC0415 (only where used)
    except ImportError as e:
        _no_browser(e)
    if not CHROMIUM.exists():
        _no_browser(f"{CHROMIUM} is missing")
    with sync_playwright() as pw:
        try:
            chromium = pw.chromium.launch(
                executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"]
            )
        except Exception as e:
            _no_browser(e)
        yield chromium
        chromium.close()


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[DockerEngine]:
    """A Docker engine for the whole session: the system's if it answers, else a private one."""
    work_dir = Path(f"/tmp/spotdrain-test-{os.getpid()}")
    try:
        engine = ensure_engine(work_dir)
    except Exception as e:
        _no_docker("no Docker engine", e)
    yield engine
    engine.stop(remove_work_dir=True)


@pytest.fixture(scope="session")
def docker_images(docker_engine: DockerEngine) -> dict[str, str]:
    """Test image names by role ("base" and each workload kind), built without a registry."""
    try:
        return ensure_images(docker_engine.client)
    except Exception as e:
        _no_docker("could not build the test images", e)


@pytest.fixture(scope="session")
def rental_image(docker_engine: DockerEngine, docker_images: dict[str, str]) -> str:
    """A renter's image (dockerenv.RENTAL_SCRIPT): runs until signalled, by its rental id."""
    return ensure_rental_image(docker_engine.client, docker_images["base"])


# --- PostgreSQL: one server for the session, a fresh database for each test ---------------------


@pytest.fixture(scope="session")
def postgres() -> Iterator[PgServer]:
    """A private PostgreSQL server for the whole session (tests/fakes/pgserver.py)."""
    try:
        server = start_postgres()
    except Exception as e:
        _no_postgres(e)
    yield server
    server.stop()


def _fresh_database(request: pytest.FixtureRequest) -> Iterator[str]:
    server: PgServer = request.getfixturevalue("postgres")
    url = fresh_database(server, request.node.name)
    yield url
    # Best effort: stopping the server at session end removes every database anyway.
    with contextlib.suppress(Exception):
        server.drop_database(database_name(url))


@pytest.fixture(params=STORE_BACKENDS, ids=STORE_BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """What a store opens: a SQLite file's path, or a fresh PostgreSQL database's URL."""
    if request.param == "sqlite":
        yield str(tmp_path / "coordinator.sqlite")
    else:
        yield from _fresh_database(request)


@pytest.fixture(params=STORE_BACKENDS, ids=STORE_BACKENDS)
def coordinator_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path | str]:
    """`db=` for harness.start_coordinator: a SQLite file (Path) kept across coordinator
    restarts in the test's work dir, or a fresh PostgreSQL database's URL."""
    if request.param == "sqlite":
        yield tmp_path / "coordinator.sqlite"
    else:
        yield from _fresh_database(request)


# --- Slurm: one cluster (munged, slurmctld, three slurmd) for the session ----------------------


def _no_slurm(error: BaseException) -> NoReturn:
    # Never a skip, as for Docker: the Slurm backend's tests must run, in CI above all.
    where = (
        "CI must run the Slurm-backed tests"
        if os.environ.get("CI") == "true"
        else "Slurm-backed tests need Debian's slurmctld, slurmd, slurm-client and munge; "
        "tests/setup.sh installs them"
    )
    raise pytest.fail.Exception(
        f"could not start the Slurm cluster: {error}\n({where})", pytrace=False
    ) from None


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A private Slurm cluster for the whole session (tests/fakes/slurm.py). A test that drains
    a node or stops the controller puts it back before it ends."""
    try:
        cluster = start_cluster()
    except Exception as e:
        _no_slurm(e)
    yield cluster
    cluster.stop()


# --- spotdrain's own parts: fake GPUs, a PKI, a coordinator process, test containers ----------


@pytest.fixture(scope="session")
def nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("nvml"))


@pytest.fixture
def gpus(tmp_path: Path) -> FakeGpus:
    g = FakeGpus(tmp_path / "gpus.state")
    g.set(gpus=2)
    return g


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki")


@pytest.fixture
def coordinator(tmp_path: Path, pki: Pki, request: pytest.FixtureRequest):
    """A coordinator on SQLite; on each backend in turn for a test that also asks for
    `coordinator_db` (the scenarios that must hold on PostgreSQL too)."""
    db = (
        request.getfixturevalue("coordinator_db")
        if "coordinator_db" in request.fixturenames
        else None
    )
    coord = start_coordinator(tmp_path / "coordinator", tls=pki, db=db)
    yield coord
    coord.proc.stop()


@pytest.fixture
def containers(docker_engine, docker_images, request):
    prefix = f"sdt-{request.node.name[:30]}-{int(time.time() * 1000) % 100000}-"
    yield prefix
    remove_test_containers(docker_engine.client, prefix)
