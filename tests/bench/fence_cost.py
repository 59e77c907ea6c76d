"""What the leader's fence costs on the Taint path (coordinator replicas, issue 10).

The coordinator's own Taint path (Drains.taint: the taint, the drain, the workers' states and
the events, one priority transaction) on a private PostgreSQL over loopback, unfenced (one
coordinator) and fenced by the lease's term (a replica leading), in alternating rounds so both
see the same machine. Prints p50/p99 of each and the ratio. Run from the checkout:

    .venv/bin/python tests/bench/fence_cost.py [--taints 2000] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fakes.pgserver import fresh_database, start_postgres  # noqa: E402
from spotdrain.coordinator.api.agent_link import Coordinator  # noqa: E402
from spotdrain.coordinator.store import open_store  # noqa: E402


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


async def run(url: str, taints: int, rounds: int) -> dict[str, list[float]]:
    store = await open_store(url)
    coord = Coordinator(store, insecure=True)
    await coord.fleet.recovery.rebuild()
    taken, term, holder, _ = await store.backend.acquire_lease("bench:1 x", 3600.0, 5.0)
    assert taken
    times: dict[str, list[float]] = {"unfenced": [], "fenced": []}
    n = 0
    try:
        for _ in range(rounds):
            for mode in ("unfenced", "fenced"):
                if mode == "fenced":
                    store.backend.fence_to(term, holder, 3600.0)
                else:
                    store.backend._fence = None  # one coordinator: no check at all
                for _ in range(taints // rounds):
                    n += 1
                    now = time.time()
                    started = time.perf_counter()
                    await coord.fleet.drains.taint(f"n{n}", f"r{n}", "notice", now + 120, now + 110)
                    times[mode].append((time.perf_counter() - started) * 1000)
    finally:
        await coord.fleet.close()
        await store.close()
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--taints", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    server = start_postgres()
    try:
        times = asyncio.run(run(fresh_database(server, "fence"), args.taints, args.rounds))
    finally:
        server.stop()
    for mode, values in times.items():
        print(
            f"{mode:9} n={len(values)} p50={statistics.median(values):.3f} ms "
            f"p99={pct(values, 99):.3f} ms max={max(values):.3f} ms"
        )
    ratio = statistics.median(times["fenced"]) / statistics.median(times["unfenced"])
    print(
        f"fenced/unfenced p50: {ratio:.2f}x, "
        f"p99: {pct(times['fenced'], 99) / pct(times['unfenced'], 99):.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
