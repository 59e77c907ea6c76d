"""Benchmark: the reference job's final checkpoint, SIGTERM -> committed, beside `cp` of the same
bytes to the same disk in the same run (the floor).

Run on demand (pytest does not collect this file; it has no test functions):

    .venv/bin/python tests/bench/checkpoint_to_commit.py [--runs 5] [--s3-runs 3]
        [--state-mb 1400] [--object-mb 64] [--dir DIR] [--json PATH]

docs/design.md "Performance targets": the final checkpoint of 1.4 GB (the published size, 31 s
there) within 1.3x of copying the same bytes to the same disk. No Docker, no agent: the job
(examples/checkpoint_job/job.py, a process of this venv's Python) holds `--state-mb` of state,
is sent SIGTERM, and writes its final checkpoint; the time is from just before the signal to the
`at` of its `checkpoint_committed` report (spotdrain.workload writes it right after the manifest
lands), so the job's start-up and state set-up are left out.

Per run, in this order, all under `--dir` (default: a temporary directory on /var/tmp's disk):

  cp          `cp` of a file holding the same bytes (written once, before the runs) to a new file
  cp+fsync    the same, then `sync FILE` (fsync): as durable as the checkpoint, which fsyncs every
              object and the manifest before it reports "committed"; this is the floor compared
  dir         the job's final checkpoint to a directory bucket (objects, fsync, manifest, rename)
  s3          the same to moto's S3 server on 127.0.0.1 (in this process; the first --s3-runs runs)

Printed: p50 and p99 (nearest rank) of each, and dir / (cp+fsync) and dir / cp at p50. Before
each timed step the disk is settled (`sync`), so no step pays for the writeback or the deletes
of the one before it. The page cache is left as it is (dropping it needs root and would time the
disk's read too).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from fakes.moto_s3 import S3Endpoint  # noqa: E402
from spotdrain.workload import parse_report  # noqa: E402

JOB = Path(__file__).parents[2] / "examples" / "checkpoint_job" / "job.py"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]


def settled() -> None:
    """Flush what the previous step left dirty or deleted (1.4 GB of writeback, the journal
    of a removed bucket) before the next timed step, so no step pays for another's."""
    os.sync()


def timed_cp(src: Path, dst: Path, fsync: bool) -> float:
    settled()
    start = time.perf_counter()
    subprocess.run(["cp", str(src), str(dst)], check=True)
    if fsync:
        subprocess.run(["sync", str(dst)], check=True)
    took = time.perf_counter() - start
    dst.unlink()
    return took


def timed_checkpoint(
    work: Path, bucket: str, state_mb: float, object_mb: float, env: dict[str, str]
) -> float:
    status = work / "status"
    shutil.rmtree(status, ignore_errors=True)
    status.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            str(JOB),
            "--bucket",
            bucket,
            "--state-mb",
            str(state_mb),
            "--object-mb",
            str(object_mb),
            "--keep",
            "1",
        ],
        env={**os.environ, **env, "SPOTDRAIN_STATUS_DIR": str(status), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("job: ready"):
            break
    else:
        raise RuntimeError(f"the job did not start: {''.join(lines)}")
    settled()
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the job failed ({proc.returncode}): {''.join(lines)}{rest}")
    reports = [parse_report(p.read_bytes()) for p in sorted(status.iterdir())]
    committed = [r for r in reports if r.kind == "checkpoint_committed"]
    if not committed:
        raise RuntimeError(f"no checkpoint_committed report: {reports}")
    return committed[-1].at - sent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--s3-runs", type=int, default=3, help="runs that also time S3 (0: none)")
    ap.add_argument("--state-mb", type=float, default=1400.0)
    ap.add_argument("--object-mb", type=float, default=64.0)
    ap.add_argument("--dir", type=Path, default=None, help="where the bytes go (one disk)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = ap.parse_args()
    if args.runs < 1 or args.s3_runs < 0 or not args.state_mb > 0 or not args.object_mb > 0:
        ap.error("--runs >= 1, --s3-runs >= 0, sizes > 0")
    work = Path(tempfile.mkdtemp(prefix="spotdrain-bench-ckpt-", dir=args.dir or "/var/tmp"))
    size = int(args.state_mb * 1024 * 1024)
    times: dict[str, list[float]] = {"cp": [], "cp+fsync": [], "dir": [], "s3": []}
    try:
        src = work / "state.bin"
        with open(src, "wb") as f:  # the same number of bytes the job holds, not zeros
            block = os.urandom(1024 * 1024)
            for _ in range(size // len(block)):
                f.write(block)
            f.write(block[: size % len(block)])
        os.sync()
        with S3Endpoint() as s3:
            for run in range(args.runs):
                times["cp"].append(timed_cp(src, work / "copy.bin", fsync=False))
                times["cp+fsync"].append(timed_cp(src, work / "copy.bin", fsync=True))
                bucket = work / f"bucket-{run}"
                times["dir"].append(
                    timed_checkpoint(work, str(bucket), args.state_mb, args.object_mb, {})
                )
                shutil.rmtree(bucket)
                if run < args.s3_runs:
                    name = f"bench-{run}"
                    s3.create_bucket(name)
                    times["s3"].append(
                        timed_checkpoint(
                            work, f"s3://{name}/job", args.state_mb, args.object_mb, s3.env
                        )
                    )
                print(
                    f"run {run + 1}: "
                    + "  ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items() if len(v) > run),
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\nfinal checkpoint of {args.state_mb:.0f} MB ({args.object_mb:.0f} MB objects), "
        f"{args.runs} runs, to {args.dir or '/var/tmp'}:"
    )
    summary = {}
    for name, values in times.items():
        if values:
            summary[name] = {"p50": pct(values, 0.5), "p99": pct(values, 0.99), "runs": values}
            print(
                f"  {name:<9} p50 {summary[name]['p50']:7.2f} s   p99 "
                f"{summary[name]['p99']:7.2f} s   "
                f"({args.state_mb / summary[name]['p50']:.0f} MB/s at p50)"
            )
    ratio = summary["dir"]["p50"] / summary["cp+fsync"]["p50"]
    ratio_cp = summary["dir"]["p50"] / summary["cp"]["p50"]
    print(f"  dir / cp+fsync at p50: {ratio:.2f}x (target <= 1.3x);  dir / cp: {ratio_cp:.2f}x")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "state_mb": args.state_mb,
                    "figures": summary,
                    "dir_over_floor": ratio,
                    "dir_over_cp": ratio_cp,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
