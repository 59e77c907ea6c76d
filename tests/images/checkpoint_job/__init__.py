"""The reference checkpointing job as a test image, built without a registry.

    ensure_checkpoint_job_image(client) -> "spotdrain-test/checkpoint-job:1"

The python base (tests/images/fake_model: a debootstrapped Debian root with python3, no pip, no
spotdrain) plus exactly two files: examples/checkpoint_job/job.py and spotdrain.workload's one
file, copied as /srv/workload.py, which is how a real workload ships the module. Committed from
a container of the base (one layer), rebuilt when either file or the base changes. The job's
settings come from its environment (CHECKPOINT_BUCKET, CHECKPOINT_STATE_MB, ...; see job.py).
This module must not import pytest.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import tarfile
import time
from pathlib import Path

import docker
import docker.errors

from images.fake_model import (
    RECIPE_LABEL,
    _digest,
    _image_with_recipe,
    _locked,
    _remove_replaced,
    cache_dir,
    ensure_python_base,
)
from spotdrain import workload

log = logging.getLogger("spotdrain.tests.checkpoint_job")

JOB_IMAGE = "spotdrain-test/checkpoint-job:1"
JOB_PY = Path(__file__).parents[3] / "examples" / "checkpoint_job" / "job.py"
WORKLOAD_PY = Path(workload.__file__)
_RECIPE = "1"
_CHANGES = (
    "ENV PYTHONDONTWRITEBYTECODE=1",
    f"CMD {json.dumps(['python3', '-u', '/srv/job.py'])}",
)


def ensure_checkpoint_job_image(client: docker.DockerClient, *, force: bool = False) -> str:
    base = ensure_python_base(client, force=force)
    files = {"job.py": JOB_PY.read_bytes(), "workload.py": WORKLOAD_PY.read_bytes()}
    recipe = _digest(
        _RECIPE.encode(),
        client.images.get(base).id.encode(),
        *(c.encode() for c in _CHANGES),
        *files.values(),
    )
    old = _image_with_recipe(client, JOB_IMAGE)
    if not force and old is not None and old[1] == recipe:
        return JOB_IMAGE
    with _locked(cache_dir() / "checkpoint-job.lock"):
        old = _image_with_recipe(client, JOB_IMAGE)
        if not force and old is not None and old[1] == recipe:
            return JOB_IMAGE
        started = time.monotonic()
        builder = client.containers.create(base, command=["true"], network_mode="none")
        try:
            if not builder.put_archive("/srv", _tar(files)):
                raise RuntimeError(f"could not put the job into a {base} container")
            repository, tag = JOB_IMAGE.rsplit(":", 1)
            image = builder.commit(
                repository,
                tag,
                changes=[*_CHANGES, f"LABEL {RECIPE_LABEL}={recipe}"],
                message="COPY job.py workload.py /srv/",
                pause=False,
            )
        finally:
            with contextlib.suppress(docker.errors.APIError):
                builder.remove(force=True)
        _remove_replaced(client, old, image.id)
        log.info("built %s in %.1fs", JOB_IMAGE, time.monotonic() - started)
    return JOB_IMAGE


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
