"""Shared fixtures. The Docker engine and test images come from tests/dockerenv.py."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from dockerenv import (
    DockerEngine,
    ensure_engine,
    ensure_images,
    ensure_rental_image,
    remove_test_containers,
)
from fakenvml import FakeGpus, build
from harness import start_coordinator
from pki import Pki


def _no_docker(what: str, error: BaseException) -> NoReturn:
    # Never a skip: Docker-backed tests must run, in CI above all (shared/DESIGN.md).
    where = (
        "CI must run the Docker-backed tests"
        if os.environ.get("CI") == "true"
        else "Docker-backed tests need an engine; tests/setup.sh installs one"
    )
    raise pytest.fail.Exception(f"{what}: {error}\n({where})", pytrace=False) from None


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
def coordinator(tmp_path: Path, pki: Pki):
    coord = start_coordinator(tmp_path / "coordinator", tls=pki)
    yield coord
    coord.proc.stop()


@pytest.fixture
def containers(docker_engine, docker_images, request):
    prefix = f"sdt-{request.node.name[:30]}-{int(time.time() * 1000) % 100000}-"
    yield prefix
    remove_test_containers(docker_engine.client, prefix)
