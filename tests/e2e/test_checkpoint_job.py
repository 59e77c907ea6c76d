"""The reference checkpointing workload (examples/checkpoint_job/job.py) against both bucket
kinds: a directory, and S3 through boto3 against moto's server. Its commit protocol (objects,
then a manifest naming the generation) must survive a SIGKILL anywhere."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
import zlib
from pathlib import Path

import pytest

from fakes.moto_s3 import S3Endpoint
from fakes.waiting import wait_until

JOB = Path(__file__).parents[2] / "examples" / "checkpoint_job" / "job.py"
RUNS = 20


class DirView:
    """The bucket as the test sees it, without the job's code."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.arg = str(root)
        self.env: dict[str, str] = {}

    def keys(self, prefix: str) -> list[str]:
        base = self.root
        return sorted(
            str(p.relative_to(base))
            for p in base.rglob("*")
            if p.is_file()
            and str(p.relative_to(base)).startswith(prefix)
            and not p.name.startswith(".")
        )

    def get(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes) -> None:
        (self.root / key).write_bytes(data)

    def delete(self, key: str) -> None:
        (self.root / key).unlink()


class S3View:
    def __init__(self, s3: S3Endpoint, bucket: str) -> None:
        self.s3 = s3
        self.client = s3.client()
        self.bucket = bucket
        self.arg = f"s3://{bucket}/job-1"
        self.env = s3.env

    def keys(self, prefix: str) -> list[str]:
        got = self.client.list_objects_v2(Bucket=self.bucket, Prefix=f"job-1/{prefix}")
        return sorted(o["Key"][len("job-1/") :] for o in got.get("Contents", []))

    def get(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=f"job-1/{key}")["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"job-1/{key}", Body=data)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=f"job-1/{key}")


@pytest.fixture(params=["dir", "s3"])
def bucket(request, tmp_path):
    if request.param == "dir":
        yield DirView(tmp_path / "bucket")
        return
    with S3Endpoint() as s3:
        # moto keeps its buckets per process, not per server: a bucket of this test's own.
        name = f"ckpt-{uuid.uuid4().hex[:12]}"
        s3.create_bucket(name)
        yield S3View(s3, name)


def committed(view) -> list[int]:
    return [int(k[len("manifests/gen-") : -len(".json")]) for k in view.keys("manifests/")]


def summed(doc_object: dict, data: bytes) -> bool:
    """Whether `data` matches an object's entry in a manifest: CRC-32 (what the job writes)
    or SHA-256 (what manifests of older generations name)."""
    if "crc32" in doc_object:
        return f"{zlib.crc32(data):08x}" == doc_object["crc32"]
    return hashlib.sha256(data).hexdigest() == doc_object["sha256"]


def check_generation(view, generation: int) -> dict:
    """Every object the manifest names is there, whole: its size and checksum match."""
    doc = json.loads(view.get(f"manifests/gen-{generation:012d}.json"))
    assert doc["generation"] == generation
    assert sum(o["size"] for o in doc["objects"]) == doc["bytes"]
    for o in doc["objects"]:
        data = view.get(o["key"])
        assert data is not None, f"generation {generation}: {o['key']} missing"
        assert len(data) == o["size"] and summed(o, data), (
            f"generation {generation}: {o['key']} is not what its manifest says"
        )
    return doc


class Run:
    """One run of the job as a process, with its own status directory."""

    def __init__(self, view, status: Path, *extra: str) -> None:
        status.mkdir(parents=True)
        self.status = status
        env = {
            **os.environ,
            **view.env,
            "SPOTDRAIN_STATUS_DIR": str(status),
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("SPOTDRAIN_DEADLINE_FILE", None)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(JOB),
                "--bucket",
                view.arg,
                "--state-mb",
                "1",
                "--object-mb",
                "0.0625",
                *extra,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"job ended before it was ready: {self.lines}")
            self.lines.append(line.rstrip("\n"))
            if line.startswith("job: ready"):
                break

    def resumed_from(self) -> int | None:
        for line in self.lines:
            if m := re.match(r"job: resumed generation (\d+) ", line):
                return int(m.group(1))
        return None

    def reports(self) -> list[str]:
        return sorted(p.name for p in self.status.iterdir() if not p.name.startswith("."))

    def finish(self, timeout: float = 30) -> int:
        out, _ = self.proc.communicate(timeout=timeout)
        self.lines += out.splitlines()
        return self.proc.returncode


def test_sigkill_anywhere_in_a_checkpoint_leaves_a_complete_generation(bucket, tmp_path):
    """Twenty times: the job resumes, is reclaimed (SIGTERM), starts its final checkpoint and
    is SIGKILLed at a random point of it (objects half written, the manifest about to land,
    old generations being removed). After every kill the bucket's newest manifest names a
    complete generation, and the next run resumes exactly from it, every object verified."""
    seed = int(time.time())
    rng = random.Random(seed)
    first = Run(bucket, tmp_path / "status-0")
    assert first.resumed_from() is None
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish() == 0, first.lines
    assert committed(bucket) == [1]
    check_generation(bucket, 1)

    cut_short = 0
    for i in range(1, RUNS + 1):
        newest = committed(bucket)[-1]
        run = Run(bucket, tmp_path / f"status-{i}", "--pace-s", "0.01")
        assert run.resumed_from() == newest, (seed, run.lines)
        run.proc.send_signal(signal.SIGTERM)
        wait_until(lambda r=run: r.reports(), 10, "checkpoint_started")
        # 16 objects, 10 ms apart: the checkpoint takes about 0.2 s, so kills land all over it.
        time.sleep(rng.uniform(0, 0.25))
        run.proc.send_signal(signal.SIGKILL)
        assert run.finish() in (-signal.SIGKILL, 0), run.lines
        after = committed(bucket)
        assert after and after[-1] in (newest, newest + 1), (seed, after)
        doc = check_generation(bucket, after[-1])
        if after[-1] == newest:
            cut_short += 1
            assert not any("committed generation" in line for line in run.lines)
        else:
            assert doc["step"] > 0
    # The kills did land inside checkpoints, not only after them (with this seed).
    assert cut_short >= 3, (seed, cut_short)

    last = Run(bucket, tmp_path / "status-last")
    newest = committed(bucket)[-1]
    assert last.resumed_from() == newest
    last.proc.send_signal(signal.SIGTERM)
    assert last.finish() == 0, last.lines
    assert committed(bucket)[-1] == newest + 1
    check_generation(bucket, newest + 1)
    # The reports of the final checkpoint: started, then committed, for the new generation.
    names = last.reports()
    assert [n.split("-", 1)[1] for n in names] == [
        f"checkpoint_started-{newest + 1}.json",
        f"checkpoint_committed-{newest + 1}.json",
    ]


def test_a_damaged_generation_is_refused_not_resumed(bucket, tmp_path):
    """A committed object that no longer matches its manifest (disk damage, a hand edit): the
    job refuses to resume from it, exit 3, and writes nothing."""
    run = Run(bucket, tmp_path / "s1")
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 0
    key = bucket.keys("gen-000000000001/")[3]
    data = bytearray(bucket.get(key))
    data[0] ^= 0xFF
    bucket.put(key, bytes(data))
    before = bucket.keys("")
    env = {**os.environ, **bucket.env}
    proc = subprocess.run(
        [sys.executable, str(JOB), "--bucket", bucket.arg],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 3
    assert f"generation 1: {key}" in proc.stderr and "does not match" in proc.stderr
    assert bucket.keys("") == before


def test_a_generation_an_older_job_committed_with_sha256_still_resumes(bucket, tmp_path):
    """Manifests written before the job moved to CRC-32 name SHA-256: a job started on such a
    bucket verifies them with SHA-256, resumes, and commits its next generation with CRC-32.
    A damaged object under a SHA-256 manifest is still refused."""
    run = Run(bucket, tmp_path / "s1")
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 0
    key = "manifests/gen-000000000001.json"
    doc = json.loads(bucket.get(key))
    assert all("crc32" in o and "sha256" not in o for o in doc["objects"])
    for o in doc["objects"]:  # rewrite it as the older job did
        o["sha256"] = hashlib.sha256(bucket.get(o["key"])).hexdigest()
        del o["crc32"]
    bucket.put(key, json.dumps(doc, sort_keys=True).encode())
    check_generation(bucket, 1)

    again = Run(bucket, tmp_path / "s2")
    assert again.resumed_from() == 1, again.lines
    again.proc.send_signal(signal.SIGTERM)
    assert again.finish() == 0, again.lines
    newer = check_generation(bucket, 2)
    assert all("crc32" in o for o in newer["objects"])

    # Damage under the older checksum is still caught.
    bucket.put(key, json.dumps(doc, sort_keys=True).encode())
    object_key = doc["objects"][2]["key"]
    data = bytearray(bucket.get(object_key))
    data[-1] ^= 0x01
    bucket.put(object_key, bytes(data))
    bucket.delete("manifests/gen-000000000002.json")  # generation 1 the newest again
    proc = subprocess.run(
        [sys.executable, str(JOB), "--bucket", bucket.arg],
        env={**os.environ, **bucket.env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 3 and "sha256" in proc.stderr, proc.stderr


def test_bad_arguments_are_refused(tmp_path):
    for args, why in [
        (["--state-mb", "nan"], "state-mb"),
        (["--object-mb", "0"], "object-mb"),
        ([], "--bucket"),
        (["--keep", "0"], "keep"),
    ]:
        full = args if "--bucket" in args or not args else ["--bucket", str(tmp_path), *args]
        if args == []:
            full = []
        env = {k: v for k, v in os.environ.items() if k != "CHECKPOINT_BUCKET"}
        proc = subprocess.run(
            [sys.executable, str(JOB), *full], env=env, capture_output=True, text=True, timeout=30
        )
        assert proc.returncode == 2 and why in proc.stderr, (args, proc.stderr)
    assert not (tmp_path / "manifests").exists() or not list((tmp_path / "manifests").iterdir())
