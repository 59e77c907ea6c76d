"""The fake model server image, built without a registry, and a helper to run it as a worker.

    ensure_model_image(client) -> "spotdrain-test/fake-model:1"
    run_model(client, name=..., node_id=..., worker_id=..., port=...) -> Container

The image is two steps, each reused while its recipe is unchanged (a label holds its hash):

1. `spotdrain-test/python-base:1`: a Debian bookworm root with python3, made by
   `debootstrap --variant=minbase --include=python3`, trimmed (apt lists and caches, docs, man
   pages, locales, gconv) and `docker import`ed. The trimmed root is cached as a tarball in
   /var/cache/spotdrain-test (or $SPOTDRAIN_TEST_CACHE), so a new engine imports it in seconds
   and debootstrap (about half a minute, needs root and the Debian mirror) runs once per machine.
   The mirror is $SPOTDRAIN_DEBIAN_MIRROR, else the first bookworm one in apt's sources that
   answers, else http://deb.debian.org/debian. (python3-minimal alone lacks http.server and json.)
2. `spotdrain-test/fake-model:1`: the base plus /srv/server.py and CMD ["python3", "-u",
   "/srv/server.py"], committed from a container of the base (one layer, about 3 s; the classic
   builder takes 15 s, since vfs copies the root for each Dockerfile instruction); rebuilt when
   server.py or the base changes.

`tests/images/fake_model/build.sh` runs `main()`: the one command that builds the image into the
engine at $DOCKER_HOST (or the default socket). This module must not import pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import hashlib
import io
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import docker
import docker.errors
from docker.models.containers import Container

log = logging.getLogger("spotdrain.tests.fake_model")

MODEL_IMAGE = "spotdrain-test/fake-model:1"
PYTHON_BASE_IMAGE = "spotdrain-test/python-base:1"
SERVER_PY = Path(__file__).with_name("server.py")
READY_LINE = "fake-model: ready on :"

SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
MIRROR_ENV = "SPOTDRAIN_DEBIAN_MIRROR"
CACHE_ENV = "SPOTDRAIN_TEST_CACHE"
DEFAULT_CACHE_DIR = Path("/var/cache/spotdrain-test")
RECIPE_LABEL = "spotdrain.test.recipe"

# Bump when the root file system recipe changes (packages, trimming), or the model layer's.
_BASE_RECIPE = "1"
_MODEL_RECIPE = "1"
_INCLUDE = ("python3",)
# Removed from the Debian root: nothing in the container needs them, and the vfs storage driver
# copies the whole root per layer and per container.
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
    "usr/share/lintian/*",
    "usr/lib/*/gconv/*",
    "usr/lib/python3*/pydoc_data",
    "etc/hostname",  # the build host's, copied by debootstrap; Docker mounts its own
)
_SBIN_PATH = "/usr/local/sbin:/usr/sbin:/sbin"

# The server layer, as a commit of a container made from the base with server.py put in it: one
# vfs copy of the root (about 3 s). `docker build` would copy it once per Dockerfile instruction.
_SERVER_PATH = "/srv/server.py"
_MODEL_CHANGES = (
    "ENV PYTHONDONTWRITEBYTECODE=1",
    f'CMD ["python3", "-u", "{_SERVER_PATH}"]',
)


class ImageBuildError(RuntimeError):
    """The fake model image could not be built."""


# ---------------------------------------------------------------------------------------------
# images


def ensure_model_image(
    client: docker.DockerClient, work_dir: Path | None = None, *, force: bool = False
) -> str:
    """Build `spotdrain-test/fake-model:1` unless it is there and current. Returns its tag.

    Current means labelled with the hash of server.py, the image config and the base image's
    id. `work_dir` holds the temporary Debian root when debootstrap runs (default: the system
    temp dir); `force` rebuilds both images (from the cached root tarball when there is one).
    """
    base = ensure_python_base(client, work_dir, force=force)
    base_id = client.images.get(base).id
    server = SERVER_PY.read_bytes()
    recipe = _digest(
        _MODEL_RECIPE.encode(), base_id.encode(), *(c.encode() for c in _MODEL_CHANGES), server
    )
    old = _image_with_recipe(client, MODEL_IMAGE)
    if not force and old is not None and old[1] == recipe:
        return MODEL_IMAGE
    with _locked(cache_dir() / "fake-model.lock"):  # one build at a time, so none is orphaned
        old = _image_with_recipe(client, MODEL_IMAGE)
        if not force and old is not None and old[1] == recipe:
            return MODEL_IMAGE
        _commit_model_image(client, base, server, recipe, old)
    return MODEL_IMAGE


def _commit_model_image(
    client: docker.DockerClient,
    base: str,
    server: bytes,
    recipe: str,
    old: tuple[str, str | None] | None,
) -> None:
    started = time.monotonic()
    repository, tag = MODEL_IMAGE.rsplit(":", 1)
    builder = client.containers.create(
        base,
        command=["true"],
        name=f"spotdrain-fake-model-builder-{os.getpid()}-{int(time.time() * 1000) % 100000}",
        network_mode="none",
    )
    try:
        if not builder.put_archive(os.path.dirname(_SERVER_PATH), _file_tar(server)):
            raise ImageBuildError(f"could not put server.py into a {base} container")
        image = builder.commit(
            repository,
            tag,
            changes=[*_MODEL_CHANGES, f"LABEL {RECIPE_LABEL}={recipe}"],
            message=f"COPY server.py {_SERVER_PATH}",
            pause=False,
        )
    except docker.errors.APIError as e:
        raise ImageBuildError(f"could not build {MODEL_IMAGE}: {e}") from e
    finally:
        with contextlib.suppress(docker.errors.APIError):
            builder.remove(force=True)
    image.reload()
    if (image.labels or {}).get(RECIPE_LABEL) != recipe:
        raise ImageBuildError(f"built {MODEL_IMAGE} but the engine dropped its label")
    _remove_replaced(client, old, image.id)
    log.info("built %s in %.1fs", MODEL_IMAGE, time.monotonic() - started)


def ensure_python_base(
    client: docker.DockerClient, work_dir: Path | None = None, *, force: bool = False
) -> str:
    """Import `spotdrain-test/python-base:1` unless it is there and current. Returns its tag.

    The Debian root comes from the cached tarball, or from debootstrap (which needs root).
    """
    recipe = _digest(_BASE_RECIPE.encode(), SUITE.encode(), *(s.encode() for s in _INCLUDE + _TRIM))
    return import_debian_root(
        client,
        PYTHON_BASE_IMAGE,
        recipe,
        cache_name="python-base",
        build=lambda tarball: _debootstrap_tarball(tarball, work_dir),
        changes=['CMD ["python3"]'],
        force=force,
    )


def import_debian_root(
    client: docker.DockerClient,
    image_tag: str,
    recipe: str,
    *,
    cache_name: str,
    build: Callable[[Path], None],
    changes: list[str],
    force: bool = False,
    suite: str = SUITE,
) -> str:
    """Import a cached Debian `suite` root tarball as `image_tag`, labelled with `recipe`, unless
    an image with that recipe is there already; `build` makes the tarball when it is not cached.
    Shared by the images built from a Debian root (this one and tests/images/systemd_debian)."""
    old = _image_with_recipe(client, image_tag)
    if not force and old is not None and old[1] == recipe:
        return image_tag
    cache = cache_dir()
    tarball = cache / f"{cache_name}-{suite}-{recipe}.tar"
    with _locked(cache / f"{cache_name}.lock"):
        old = _image_with_recipe(client, image_tag)
        if not force and old is not None and old[1] == recipe:
            return image_tag  # imported meanwhile by another build
        if not tarball.exists():
            build(tarball)
        started = time.monotonic()
        repository, tag = image_tag.rsplit(":", 1)
        client.api.import_image_from_file(
            str(tarball),
            repository=repository,
            tag=tag,
            changes=[
                "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "ENV LANG=C.UTF-8",
                *changes,
                f"LABEL {RECIPE_LABEL}={recipe}",
            ],
        )
    image = client.images.get(image_tag)
    if (image.labels or {}).get(RECIPE_LABEL) != recipe:
        raise ImageBuildError(f"imported {image_tag} but the engine dropped its label")
    _remove_replaced(client, old, image.id)
    log.info("imported %s from %s in %.1fs", image_tag, tarball, time.monotonic() - started)
    return image_tag


def cache_dir() -> Path:
    """Where the trimmed Debian root tarball is kept: $SPOTDRAIN_TEST_CACHE, else
    /var/cache/spotdrain-test, else ~/.cache/spotdrain-test when that is not writable."""
    candidates = [
        os.environ.get(CACHE_ENV),
        DEFAULT_CACHE_DIR,
        Path.home() / ".cache/spotdrain-test",
    ]
    for candidate in filter(None, candidates):
        path = Path(candidate)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    raise ImageBuildError(f"no writable cache dir among {candidates}")


def debian_mirror(suite: str = SUITE) -> str:
    """The Debian mirror for debootstrap of `suite`: $SPOTDRAIN_DEBIAN_MIRROR, else the first
    bookworm mirror in apt's sources whose Release file for `suite` answers, else
    deb.debian.org. (apt here names this machine's release only; a mirror serves them all.)"""
    override = os.environ.get(MIRROR_ENV)
    if override:
        return override.rstrip("/")
    candidates = [*_apt_mirrors(), DEFAULT_MIRROR]
    tried = []
    for mirror in dict.fromkeys(m.rstrip("/") for m in candidates):
        try:
            with urllib.request.urlopen(f"{mirror}/dists/{suite}/Release", timeout=10) as r:
                if r.status == 200:
                    return mirror
        except (OSError, urllib.error.URLError) as e:
            tried.append(f"{mirror}: {e}")
    raise ImageBuildError("no Debian mirror answers:\n  " + "\n  ".join(tried))


def _apt_mirrors() -> list[str]:
    """URIs of apt sources for the plain SUITE (not -security or -updates), in apt's order."""
    found: list[str] = []
    paths = [Path("/etc/apt/sources.list")]
    paths += sorted(Path("/etc/apt/sources.list.d").glob("*.list"))
    paths += sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
    for path in paths:
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.suffix == ".sources":  # deb822 stanzas
            for stanza in text.split("\n\n"):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line or line[:1].isspace():
                        continue
                    key, value = line.split(":", 1)
                    fields[key.strip().lower()] = value.strip()
                if fields.get("enabled", "yes").lower() == "no":
                    continue
                if (
                    "deb" in fields.get("types", "").split()
                    and SUITE in fields.get("suites", "").split()
                ):
                    found += fields.get("uris", "").split()
        else:
            for line in text.splitlines():
                words = line.split("#", 1)[0].split()
                if words[:1] != ["deb"]:
                    continue
                words = words[1:]
                if words and words[0].startswith("["):  # [arch=... signed-by=...]
                    while words and not words[0].endswith("]"):
                        words.pop(0)
                    words = words[1:]
                if len(words) >= 2 and words[1] == SUITE:
                    found.append(words[0])
    return [uri for uri in found if uri.startswith(("http://", "https://"))]


def _debootstrap_tarball(tarball: Path, work_dir: Path | None) -> None:
    """debootstrap a Debian root with python3, trim it, and write it to `tarball` atomically."""
    debootstrap_tarball(tarball, work_dir, include=_INCLUDE, trim=_TRIM, what="python3")


def debootstrap_tarball(
    tarball: Path,
    work_dir: Path | None,
    *,
    include: tuple[str, ...],
    trim: tuple[str, ...],
    what: str,
    customize: Callable[[Path], None] | None = None,
    suite: str = SUITE,
) -> None:
    """debootstrap a minimal Debian root with `include`, delete what `trim` globs, let
    `customize` adjust the root, and write it to `tarball` atomically (shared by the images
    built from a Debian root: this one and tests/images/systemd_debian)."""
    if os.geteuid() != 0:
        raise ImageBuildError(
            f"{tarball} is not cached and building it runs debootstrap, which needs root"
        )
    debootstrap = shutil.which("debootstrap", path=os.environ.get("PATH", "") + ":" + _SBIN_PATH)
    if debootstrap is None:
        raise ImageBuildError("debootstrap is not installed (apt-get install debootstrap)")
    mirror = debian_mirror(suite)
    started = time.monotonic()
    with _temp_dir(work_dir, "debian-rootfs-") as tmp:
        root = tmp / "root"
        log_path = tmp / "debootstrap.log"
        env = dict(os.environ, PATH=os.environ.get("PATH", "") + ":" + _SBIN_PATH)
        log.info("debootstrap %s with %s from %s into %s", suite, include, mirror, root)
        try:
            with open(log_path, "wb") as out:
                result = subprocess.run(
                    [
                        debootstrap,
                        "--variant=minbase",
                        f"--include={','.join(include)}",
                        suite,
                        str(root),
                        mirror,
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    timeout=900,
                )
            if result.returncode != 0:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
                raise ImageBuildError(f"debootstrap failed ({result.returncode}):\n{tail}")
            for pattern in trim:
                for path in glob.glob(str(root / pattern)):
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path)
                    else:
                        os.unlink(path)
            (root / "etc/resolv.conf").write_text("")  # the build host's; Docker mounts its own
            if customize is not None:
                customize(root)
            partial = tarball.with_name(f".{tarball.name}.{os.getpid()}.partial")
            try:
                subprocess.run(
                    [
                        "tar",
                        "--numeric-owner",
                        "--xattrs",
                        "-C",
                        str(root),
                        "--exclude=./dev/*",
                        "--exclude=./proc/*",
                        "--exclude=./sys/*",
                        "-cf",
                        str(partial),
                        ".",
                    ],
                    check=True,
                    capture_output=True,
                    timeout=300,
                )
                os.replace(partial, tarball)
            finally:
                partial.unlink(missing_ok=True)
        finally:
            _unmount_under(root)  # debootstrap mounts proc and sys in the root while it runs
    log.info(
        "cached the %s root with %s (%.0f MB) in %s in %.1fs",
        suite,
        what,
        tarball.stat().st_size / 1e6,
        tarball,
        time.monotonic() - started,
    )


def _image_with_recipe(client: docker.DockerClient, tag: str) -> tuple[str, str | None] | None:
    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    return image.id, (image.labels or {}).get(RECIPE_LABEL)


def _remove_replaced(
    client: docker.DockerClient, old: tuple[str, str | None] | None, new_id: str
) -> None:
    """Drop the image a rebuild untagged (with vfs, each is a full copy of the root)."""
    if old is None or old[0] == new_id:
        return
    try:
        client.images.remove(old[0])
    except docker.errors.APIError as e:  # still used by a container or a child image
        log.info("kept replaced image %s: %s", old[0][:19], e.explanation)


def _file_tar(data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(os.path.basename(_SERVER_PATH))
        info.size = len(data)
        info.mode = 0o644
        info.mtime = int(time.time())
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _digest(*parts: bytes) -> str:
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _temp_dir(parent: Path | None, prefix: str):
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield path
    finally:
        _unmount_under(path)
        # --one-file-system: never delete through a mount that could not be detached.
        subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


def _unmount_under(path: Path) -> None:
    prefix = str(Path(path).absolute()) + "/"
    try:
        with open("/proc/self/mounts") as mounts:
            points = [line.split()[1] for line in mounts]
    except OSError:
        return
    for point in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


# ---------------------------------------------------------------------------------------------
# running a worker


def run_model(
    client: docker.DockerClient,
    *,
    name: str,
    node_id: str,
    worker_id: str,
    model: str = "fake-model",
    port: int,
    tokens_per_s: float = 50,
    image: str = MODEL_IMAGE,
    extra_labels: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    ready_timeout: float = 20.0,
) -> Container:
    """Run the fake model server as an inference worker; return once GET /health answers.

    Host network (a private engine has no bridge), listening on `port`. Labels:
    spotdrain.node, spotdrain.kind=inference, spotdrain.worker, spotdrain.model, plus
    `extra_labels`. Env PORT, WORKER_ID, MODEL, TOKENS_PER_S, plus `env` (e.g. TOKENS).
    The image must exist (`ensure_model_image`). If the server is not healthy within
    `ready_timeout`, the container is killed (kept for inspection) and RuntimeError raised with
    its logs.
    """
    labels = {
        "spotdrain.node": node_id,
        "spotdrain.kind": "inference",
        "spotdrain.worker": worker_id,
        "spotdrain.model": model,
        **(extra_labels or {}),
    }
    environment = {
        "PORT": str(port),
        "WORKER_ID": worker_id,
        "MODEL": model,
        "TOKENS_PER_S": str(tokens_per_s),
        **(env or {}),
    }
    container = client.containers.run(
        image,
        name=name,
        labels=labels,
        environment=environment,
        network_mode="host",
        detach=True,
        auto_remove=False,
    )
    try:
        wait_model_ready(container, port, worker_id, ready_timeout)
    except BaseException:
        with contextlib.suppress(docker.errors.APIError):
            container.kill()
        raise
    return container


def wait_model_ready(container: Container, port: int, worker_id: str, timeout: float) -> None:
    """Wait until 127.0.0.1:`port`/health answers 200 from `worker_id` (its X-Worker-Id)."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                answered_by = r.headers.get("X-Worker-Id")
                if r.status == 200 and answered_by == worker_id:
                    return
                last = f"HTTP {r.status} from worker {answered_by!r}"
        except (OSError, urllib.error.URLError) as e:
            last = str(e)
        container.reload()
        if container.status not in ("created", "running"):
            raise RuntimeError(
                f"model worker {container.name} ended ({container.status}, exit "
                f"{container.attrs['State'].get('ExitCode')}) before it was healthy; logs:\n"
                f"{container.logs().decode(errors='replace')}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"model worker {container.name} not healthy on :{port} within {timeout}s "
                f"({last}); logs:\n{container.logs().decode(errors='replace')}"
            )
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# build.sh


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tests/images/fake_model/build.sh",
        description=f"Build {MODEL_IMAGE} into the engine at $DOCKER_HOST (or the default socket).",
    )
    parser.add_argument("--work-dir", type=Path, help="where to put the temporary Debian root")
    parser.add_argument("--force", action="store_true", help="rebuild even if the image is current")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="build.sh: %(message)s", stream=sys.stderr)
    try:
        client = docker.from_env(version="auto", timeout=300)
        client.ping()
    except docker.errors.DockerException as e:
        host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        print(f"build.sh: no Docker engine answers at {host}: {e}", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        tag = ensure_model_image(client, args.work_dir, force=args.force)
    except ImageBuildError as e:
        print(f"build.sh: {e}", file=sys.stderr)
        return 1
    image = client.images.get(tag)
    log.info(
        "%s is %s, %.0f MB, ready in %.1fs",
        tag,
        image.short_id,
        (image.attrs.get("Size") or 0) / 1e6,
        time.monotonic() - started,
    )
    print(tag)
    return 0
