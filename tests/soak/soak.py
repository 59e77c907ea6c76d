"""The reclamation soak, on demand (issue 11): N randomized reclamations on a real Docker engine
with short deadlines, spread over K agents on one coordinator, while a fault injector SIGKILLs
or SIGSTOPs the coordinator and SIGKILLs agents. Prints the counts of broken promises (each
target 0) and the findings behind any that is not; exits 1 if any is not 0. Pytest does not
collect this file; tests/e2e/test_soak.py runs 30 reclamations in CI.

    .venv/bin/python tests/soak/soak.py                                # 1,000 reclamations, 4 nodes
    .venv/bin/python tests/soak/soak.py --reclamations 200 --nodes 4 --json /tmp/soak.json
    .venv/bin/python tests/soak/soak.py --seed 1234 --reclamations 30   # replay a seed
    .venv/bin/python tests/soak/soak.py --no-faults                     # the same, no faults

Needs root and a Docker engine, or `dockerd` to start a private one (tests/setup.sh installs
it); everything it starts it removes again (the work dir too, unless --keep or a failure).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fakes.dockerenv import ensure_engine, ensure_images  # noqa: E402
from fakes.fakenvml import build  # noqa: E402
from soak.counts import count, report  # noqa: E402
from soak.scenario import Soak, SoakConfig  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reclamations", type=int, default=1000)
    p.add_argument("--nodes", type=int, default=4, help="agents on the one coordinator")
    p.add_argument("--seed", type=int, default=None, help="default: a random one, printed")
    p.add_argument("--no-faults", action="store_true", help="no fault injection")
    p.add_argument(
        "--fault-every-s",
        type=float,
        nargs=2,
        default=(1.0, 6.0),
        metavar=("MIN", "MAX"),
        help="seconds between faults, uniform",
    )
    p.add_argument("--json", type=Path, help="write the counts and findings here")
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, state)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    config = replace(
        SoakConfig(),
        reclamations=args.reclamations,
        nodes=args.nodes,
        seed=seed,
        faults=not args.no_faults,
        fault_every_s=tuple(args.fault_every_s),
    )
    print(
        f"soak: seed {seed} (replay with --seed {seed}), {config.reclamations} reclamations "
        f"on {config.nodes} nodes, faults {'on' if config.faults else 'off'}",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="sdsoak-", dir="/tmp"))
    print(f"soak: work dir {work}", flush=True)
    keep = args.keep
    engine = ensure_engine(work / "docker")
    try:
        ensure_images(engine.client)
        soak = Soak(
            config,
            work,
            engine.host,
            build(work / "nvml"),
            prefix=f"sdsoak-{os.getpid()}-",
            say=lambda s: print(s, flush=True),
        )
        started = time.monotonic()
        soak.run()
        counts = count(soak)
        print(report(counts, seed))
        print(f"soak: wall time {time.monotonic() - started:.0f} s", flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(
                json.dumps({"seed": seed, "nodes": config.nodes, **counts.to_json()}, indent=2)
                + "\n"
            )
            print(f"soak: wrote {args.json}")
        keep = keep or counts.failed
        return 1 if counts.failed else 0
    except BaseException:
        keep = True  # the logs of a failed run are what explains it
        raise
    finally:
        engine.stop(remove_work_dir=True)
        if keep:
            print(f"soak: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
