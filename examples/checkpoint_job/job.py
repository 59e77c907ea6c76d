"""The reference checkpointing workload: a batch job that holds state in memory, works on it, and
on reclamation writes its final checkpoint to a bucket, then exits 0.

    python3 job.py --bucket DIR|s3://BUCKET/PREFIX [--state-mb 512] [--object-mb 64]
                   [--every-s 0] [--endpoint-url URL]

It uses spotdrain.workload (the one file, copied beside this one in an image, or the installed
package): the final checkpoint starts on the first SIGTERM or the first sight of the deadline
file, whichever comes first, and its progress is reported into $SPOTDRAIN_STATUS_DIR.

The bucket is a directory or an S3-compatible store (boto3, imported only for s3://). A
checkpoint is committed in two steps, so a job killed at any moment leaves the newest committed
generation intact:

1. the objects, under `gen-<G>/obj-<i>` (a directory bucket fsyncs each one);
2. the manifest `manifests/gen-<G>.json`, naming the generation, the job's step and every object
   with its size and CRC-32: one atomic write (rename in a directory, one PUT in S3).

The checksum is there to catch an object torn, truncated or damaged at rest, not an adversary
(whoever can write the bucket can write the manifest too), so it is CRC-32, the checksum S3 and
zip use for the same job: zlib computes it at twice SHA-256's speed, and the final checkpoint
runs against the grace deadline. Manifests that name SHA-256 (older generations) still verify.

A generation without a manifest does not exist. A job started again reads the newest manifest,
fetches its objects and checks each against it before it trusts any byte (a mismatch is an
error, exit 3, never a silent resume), then carries on from that generation. After a commit,
generations older than the newest `--keep` are removed, manifest first.

Exit codes: 0 after the final checkpoint (or when the work ran out), 2 for bad arguments, 3 for
a bucket whose committed generation does not verify.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # the installed package; in an image, the one file copied beside this one
    from spotdrain import workload
except ImportError:  # pragma: no cover (exercised in the container and the bare-python test)
    import workload  # type: ignore[no-redef]

MANIFESTS = "manifests/"
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
MiB = 1024 * 1024


class BucketCorrupt(Exception):
    """A committed generation does not match its manifest."""


# The checksum new manifests use, and every one a manifest may name (hex digest lengths).
CHECKSUM = "crc32"
CHECKSUM_HEX = {"crc32": 8, "sha256": 64}


def checksum(name: str, data: bytes | memoryview) -> str:
    if name == "crc32":
        return f"{zlib.crc32(data):08x}"
    return hashlib.sha256(data).hexdigest()


def manifest_key(generation: int) -> str:
    return f"{MANIFESTS}gen-{generation:012d}.json"


def object_key(generation: int, index: int) -> str:
    return f"gen-{generation:012d}/obj-{index:06d}"


# --- buckets -----------------------------------------------------------------------------------


# Objects are summed and written in pieces of this size: one pass over memory for both.
PIECE = 4 * 1024 * 1024


class DirBucket:
    """A directory as a bucket. Objects are written `parallel` at a time, each one's writeback
    started as soon as it is written, and fsynced all together just before the manifest, which
    lands by rename. One fsync per object as it is written would make each wait for its own
    journal commit; fsyncs issued together share commits. Nothing changes for a killed job: no
    manifest names a generation until every object of it is durable."""

    parallel = 3

    def __init__(self, root: Path, fsync: bool = True) -> None:
        self.root = root
        self.fsync = fsync
        self._unsynced_dirs: set[Path] = set()
        self._unsynced: list[Path] = []
        self._lock = threading.Lock()
        (root / MANIFESTS).mkdir(parents=True, exist_ok=True)

    def put_object(self, key: str, data: memoryview) -> str:
        """Write one object; its CRC-32, computed in the same pass: each piece is summed
        while it is still in the CPU's cache, then written."""
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        self._unsynced_dirs.add(path.parent)
        crc = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for at in range(0, len(data), PIECE):
                view = data[at : at + PIECE]
                crc = zlib.crc32(view, crc)
                while view:
                    view = view[os.write(fd, view) :]
            # Start writing this object to the disk now, while the next ones are still being
            # copied: on Linux this advice begins writeback of the dirty range without waiting
            # for it (and drops the pages once clean; nobody reads a checkpoint back soon), so
            # the fsyncs before the manifest wait for the tail, not for every byte.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        with self._lock:
            self._unsynced.append(path)
        return f"{crc:08x}"

    def _sync_objects(self) -> None:
        """fsync every object written since the last manifest, all at once."""
        with self._lock:
            paths, self._unsynced = self._unsynced, []
        if not self.fsync or not paths:
            return
        with ThreadPoolExecutor(max_workers=min(len(paths), 32)) as pool:
            for done in pool.map(_fsync_file, paths):
                del done

    def put_manifest(self, key: str, data: bytes) -> None:
        self._sync_objects()  # every object durable before a manifest names it
        path = self.root / key
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if self.fsync:  # the objects' names are durable before a manifest names them
            for d in self._unsynced_dirs:
                _fsync_dir(d)
            _fsync_dir(self.root)
        self._unsynced_dirs.clear()
        os.replace(tmp, path)
        if self.fsync:
            _fsync_dir(path.parent)

    def get(self, key: str, limit: int | None = None) -> bytes:
        with open(self.root / key, "rb") as f:
            return f.read() if limit is None else f.read(limit + 1)

    def manifests(self) -> list[str]:
        return sorted(
            MANIFESTS + p.name
            for p in (self.root / MANIFESTS).glob("gen-*.json")
            if not p.name.startswith(".")
        )

    def generations_on_disk(self) -> list[int]:
        out = []
        for p in self.root.glob("gen-*"):
            try:
                out.append(int(p.name[4:]))
            except ValueError:
                continue
        return sorted(out)

    def delete_manifest(self, key: str) -> None:
        (self.root / key).unlink(missing_ok=True)

    def delete_generation(self, generation: int) -> None:
        shutil.rmtree(self.root / f"gen-{generation:012d}", ignore_errors=True)


class S3Bucket:
    """An S3-compatible bucket through boto3; each PUT is atomic, so the manifest's is the
    commit. Objects go up a few at a time."""

    def __init__(self, url: str, endpoint_url: str | None = None, parallel: int = 4) -> None:
        import boto3  # noqa: PLC0415 (only a job with an s3:// bucket needs it)

        rest = url[len("s3://") :]
        self.name, _, prefix = rest.partition("/")
        if not self.name:
            raise ValueError(f"no bucket name in {url!r}")
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.client = boto3.client("s3", endpoint_url=endpoint_url)
        self.parallel = parallel

    def put_object(self, key: str, data: memoryview) -> str:
        body = bytes(data)
        self.client.put_object(Bucket=self.name, Key=self.prefix + key, Body=body)
        return checksum(CHECKSUM, body)

    def put_manifest(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.name, Key=self.prefix + key, Body=data)

    def get(self, key: str, limit: int | None = None) -> bytes:
        args: dict[str, Any] = {"Bucket": self.name, "Key": self.prefix + key}
        if limit is not None:
            args["Range"] = f"bytes=0-{limit}"
        return self.client.get_object(**args)["Body"].read()

    def _keys(self, prefix: str) -> Iterator[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.name, Prefix=self.prefix + prefix
        )
        for page in pages:
            for obj in page.get("Contents", []):
                yield obj["Key"][len(self.prefix) :]

    def manifests(self) -> list[str]:
        return sorted(k for k in self._keys(MANIFESTS) if k.endswith(".json"))

    def generations_on_disk(self) -> list[int]:
        out = set()
        for key in self._keys("gen-"):
            try:
                out.add(int(key.split("/", 1)[0][4:]))
            except ValueError:
                continue
        return sorted(out)

    def delete_manifest(self, key: str) -> None:
        self.client.delete_object(Bucket=self.name, Key=self.prefix + key)

    def delete_generation(self, generation: int) -> None:
        keys = list(self._keys(f"gen-{generation:012d}/"))
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(
                Bucket=self.name,
                Delete={"Objects": [{"Key": self.prefix + k} for k in keys[i : i + 1000]]},
            )


Bucket = DirBucket | S3Bucket


def open_bucket(where: str, endpoint_url: str | None = None, fsync: bool = True) -> Bucket:
    if where.startswith("s3://"):
        return S3Bucket(where, endpoint_url)
    return DirBucket(Path(where), fsync=fsync)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- manifests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    generation: int
    step: int
    size: int
    objects: tuple[tuple[str, int, str], ...]  # (key, size, checksum hex)
    checksum: str = CHECKSUM  # which one, the same for every object

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "generation": self.generation,
                "step": self.step,
                "bytes": self.size,
                "objects": [{"key": k, "size": s, self.checksum: h} for k, s, h in self.objects],
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def parse(cls, raw: bytes, key: str) -> Manifest:
        """A manifest, checked: a manifest is written whole (rename, or one PUT), so a bad one
        is damage, not a checkpoint in progress."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise BucketCorrupt(f"{key}: larger than {MAX_MANIFEST_BYTES} bytes")
        try:
            doc = json.loads(raw)
            generation, step, size = doc["generation"], doc["step"], doc["bytes"]
            named = {name for o in doc["objects"] for name in CHECKSUM_HEX if name in o}
            algorithm = named.pop() if len(named) == 1 else CHECKSUM
            objects = tuple((o["key"], o["size"], o[algorithm]) for o in doc["objects"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BucketCorrupt(f"{key}: not a manifest ({e})") from None
        if named:
            raise BucketCorrupt(f"{key}: objects name different checksums")
        ints = [generation, step, size, *(s for _, s, _ in objects)]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in ints):
            raise BucketCorrupt(f"{key}: counts must be integers >= 0")
        if key != manifest_key(generation):
            raise BucketCorrupt(f"{key}: names generation {generation}")
        if sum(s for _, s, _ in objects) != size:
            raise BucketCorrupt(f"{key}: object sizes do not add up to {size}")
        for i, (k, _, h) in enumerate(objects):
            if (
                k != object_key(generation, i)
                or not isinstance(h, str)
                or (len(h) != CHECKSUM_HEX[algorithm])
            ):
                raise BucketCorrupt(f"{key}: object {i} is {k!r}")
        return cls(generation, step, size, objects, algorithm)


def newest_manifest(bucket: Bucket) -> Manifest | None:
    keys = bucket.manifests()
    if not keys:
        return None
    return Manifest.parse(bucket.get(keys[-1], MAX_MANIFEST_BYTES), keys[-1])


def load_generation(bucket: Bucket, manifest: Manifest) -> bytearray:
    """The state of a committed generation, every object checked against the manifest."""
    state = bytearray(manifest.size)
    at = 0
    for key, size, digest in manifest.objects:
        try:
            data = bucket.get(key)
        except (FileNotFoundError, OSError) as e:
            raise BucketCorrupt(f"generation {manifest.generation}: {key} missing: {e}") from e
        except Exception as e:  # botocore's NoSuchKey and friends
            raise BucketCorrupt(f"generation {manifest.generation}: {key}: {e}") from e
        if len(data) != size or checksum(manifest.checksum, data) != digest:
            raise BucketCorrupt(
                f"generation {manifest.generation}: {key} is {len(data)} bytes and does not "
                f"match its manifest ({size} bytes, {manifest.checksum} {digest[:12]})"
            )
        state[at : at + size] = data
        at += size
    return state


# --- the job -----------------------------------------------------------------------------------


class Job:
    def __init__(
        self,
        bucket: Bucket,
        state_bytes: int,
        object_bytes: int,
        keep: int = 2,
        reporter: workload.Reporter | None = None,
        pace_s: float = 0.0,
        log=print,
    ) -> None:
        self.bucket = bucket
        self.object_bytes = object_bytes
        self.keep = keep
        self.reporter = reporter or workload.Reporter()
        self.pace_s = pace_s  # tests: a pause between objects, so a kill can land mid-write
        self.log = log
        self.reclaimed = threading.Event()
        manifest = newest_manifest(bucket)
        if manifest is None:
            self.generation, self.step = 0, 0
            # Distinct bytes everywhere, cheaply: a checkpoint of zeros would prove little.
            self.state = bytearray(state_bytes)
            seed = hashlib.sha256(b"spotdrain reference job").digest()
            for at in range(0, state_bytes, MiB):
                block = (seed * (MiB // len(seed) + 1))[: min(MiB, state_bytes - at)]
                self.state[at : at + len(block)] = block
                seed = hashlib.sha256(seed).digest()
            self.log(f"job: fresh state of {state_bytes} bytes", flush=True)
        else:
            self.state = load_generation(bucket, manifest)
            self.generation, self.step = manifest.generation, manifest.step
            self.log(
                f"job: resumed generation {manifest.generation} at step {manifest.step} "
                f"({manifest.size} bytes, every object verified)",
                flush=True,
            )

    def work(self, steps: int = 1) -> None:
        """One unit of "training": the step counter moves and a few bytes change with it."""
        for _ in range(steps):
            self.step += 1
            at = (self.step * 4099) % max(len(self.state) - 8, 1)
            self.state[at : at + 8] = self.step.to_bytes(8, "little")

    def checkpoint(self) -> Manifest:
        """Write one generation and commit it: objects first, then the manifest."""
        generation = self.generation + 1
        # Leftovers of a checkpoint killed before its manifest: never committed, so never read.
        self.bucket.delete_generation(generation)
        self.reporter.checkpoint_started(generation)
        view = memoryview(self.state)
        objects = []
        with ThreadPoolExecutor(max_workers=self.bucket.parallel) as pool:
            # Each put sums what it writes (zlib lets go of the GIL for large buffers).
            pending = []
            for i, at in enumerate(range(0, len(view), self.object_bytes)):
                chunk = view[at : at + self.object_bytes]
                key = object_key(generation, i)
                pending.append((key, len(chunk), pool.submit(self.bucket.put_object, key, chunk)))
                if self.pace_s:
                    time.sleep(self.pace_s)
            for key, size, put in pending:
                objects.append((key, size, put.result()))
        manifest = Manifest(generation, self.step, len(self.state), tuple(objects))
        self.bucket.put_manifest(manifest_key(generation), manifest.to_bytes())
        self.generation = generation
        self.reporter.checkpoint_committed(generation, manifest.size)
        self.log(f"job: committed generation {generation} at step {self.step}", flush=True)
        self._collect()
        return manifest

    def _collect(self) -> None:
        """Remove generations older than the newest `keep`: manifest first, so a kill here
        leaves objects nobody names, never a manifest naming missing objects."""
        keys = self.bucket.manifests()
        committed = sorted(int(k[len(MANIFESTS) + 4 : -5]) for k in keys)
        kept = set(committed[-self.keep :])
        for g in committed:
            if g not in kept:
                self.bucket.delete_manifest(manifest_key(g))
        for g in self.bucket.generations_on_disk():
            if g not in kept and g < self.generation:
                self.bucket.delete_generation(g)

    def run(self, every_s: float, max_steps: int | None = None) -> int:
        """Work until reclaimed (then the final checkpoint) or until `max_steps` are done."""
        reclaim = workload.on_reclaim(self._on_reclaim)
        self.log("job: ready", flush=True)
        last = time.monotonic()
        done = 0
        try:
            while not self.reclaimed.is_set():
                self.work(100)
                done += 100
                if max_steps is not None and done >= max_steps:
                    break
                if every_s and time.monotonic() - last >= every_s:
                    self.checkpoint()
                    last = time.monotonic()
                self.reclaimed.wait(0.01)
            left = reclaim.time_left()
            self.log(
                f"job: reclaimed ({reclaim.trigger or 'no'}; "
                f"{'no deadline' if left is None else f'{left:.1f} s to G'}): final checkpoint",
                flush=True,
            )
            self.checkpoint()
        finally:
            reclaim.close()
        return 0

    def _on_reclaim(self, deadline: workload.Deadline | None) -> None:
        self.reclaimed.set()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--bucket",
        default=os.environ.get("CHECKPOINT_BUCKET", ""),
        help="a directory, or s3://BUCKET/PREFIX ($CHECKPOINT_BUCKET)",
    )
    ap.add_argument("--endpoint-url", default=os.environ.get("AWS_ENDPOINT_URL") or None)
    ap.add_argument(
        "--state-mb", type=float, default=float(os.environ.get("CHECKPOINT_STATE_MB", "512"))
    )
    ap.add_argument(
        "--object-mb", type=float, default=float(os.environ.get("CHECKPOINT_OBJECT_MB", "64"))
    )
    ap.add_argument(
        "--every-s",
        type=float,
        default=float(os.environ.get("CHECKPOINT_EVERY_S", "0")),
        help="also checkpoint this often while working (0: only the final one)",
    )
    ap.add_argument("--keep", type=int, default=2, help="committed generations kept")
    ap.add_argument("--pace-s", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--no-fsync", action="store_true", help="directory bucket: skip fsync")
    args = ap.parse_args(argv)
    for name in ("state_mb", "object_mb", "every_s", "pace_s"):
        value = getattr(args, name)
        sized = name in ("state_mb", "object_mb")
        if not math.isfinite(value) or value < 0 or (sized and not value):
            ap.error(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if not args.bucket:
        ap.error("--bucket (or $CHECKPOINT_BUCKET) is needed")
    if args.keep < 1:
        ap.error("--keep must be at least 1")
    try:
        bucket = open_bucket(args.bucket, args.endpoint_url, fsync=not args.no_fsync)
        job = Job(
            bucket,
            int(args.state_mb * MiB),
            max(int(args.object_mb * MiB), 1),
            keep=args.keep,
            pace_s=args.pace_s,
        )
    except BucketCorrupt as e:
        print(f"job: {e}", file=sys.stderr, flush=True)
        return 3
    return job.run(args.every_s)


if __name__ == "__main__":
    sys.exit(main())
