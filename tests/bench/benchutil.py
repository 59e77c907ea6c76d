"""What the benchmarks in this directory share: percentiles, a summary row, the environment, and
one table format. Not a benchmark itself; pytest collects nothing here."""

from __future__ import annotations

import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any


def say(text: str) -> None:
    print(f"bench: {text}", flush=True)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    if not s:
        return float("nan")
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50_ms": percentile(values, 0.50),
        "p99_ms": percentile(values, 0.99),
        "max_ms": max(values),
        "mean_ms": statistics.fmean(values),
        "min_ms": min(values),
        "first_ms": values[0],
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def base_environment() -> dict[str, Any]:
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "?"
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": load,
    }


def print_environment(env: dict[str, Any]) -> None:
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))


def table(rows: list[tuple[str, dict[str, float], str]], width: int = 44) -> None:
    """One line per (name, summary, note): n, p50, p99, max, min, first (ms)."""
    header = (
        f"{'path':<{width}}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}"
        f"{'min ms':>9}{'first ms':>10}  note"
    )
    print(header)
    print("-" * (len(header) + 30))
    for name, s, note in rows:
        if not s.get("n"):
            print(f"{name:<{width}}{0:>6}  (no samples)  {note}")
            continue
        print(
            f"{name:<{width}}{s['n']:>6}{s['p50_ms']:>10.2f}{s['p99_ms']:>10.2f}"
            f"{s['max_ms']:>10.2f}{s['min_ms']:>9.2f}{s['first_ms']:>10.2f}  {note}"
        )


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"
