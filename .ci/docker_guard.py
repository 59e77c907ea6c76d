"""pytest plugin for CI: Docker-, PostgreSQL-, browser- and Slurm-backed tests must run, never
be skipped (docs/design.md).

Loaded by .ci/run with `-p docker_guard`. Tests marked `docker`, `postgres`, `browser` or `slurm`
(tests/conftest.py marks every test that uses the `postgres` fixture or the postgresql param of
`store_url` or `coordinator_db`, every test that uses the `browser` fixture, and every test that
uses the `slurm_cluster` fixture) that were skipped, or no such test of one kind running at
all, fail the session. The tally is written as JSON to $SPOTDRAIN_CI_REPORT so .ci/run can check it
independently of pytest's exit code.
"""

from __future__ import annotations

import json
import os

import pytest

# marker -> what its tests are backed by, for the messages
_GUARDED = {"docker": "Docker", "postgres": "PostgreSQL", "browser": "browser", "slurm": "Slurm"}

_ran: dict[str, set[str]] = {marker: set() for marker in _GUARDED}
_skipped: dict[str, dict[str, str]] = {marker: {} for marker in _GUARDED}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if hasattr(report, "wasxfail"):
        return
    for marker in _GUARDED:
        if marker not in report.keywords:
            continue
        if report.skipped:
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            _skipped[marker][report.nodeid] = reason
        elif report.when == "call":
            _ran[marker].add(report.nodeid)


def _problems() -> list[str]:
    problems = []
    for marker, backend in _GUARDED.items():
        problems += [
            f"{backend.lower()} test skipped: {nodeid}: {reason}"
            for nodeid, reason in _skipped[marker].items()
        ]
        if not _ran[marker]:
            problems.append(f"no {backend}-backed test ran")
    return problems


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    problems = _problems()
    path = os.environ.get("SPOTDRAIN_CI_REPORT")
    if path:
        report = {
            marker: {"ran": sorted(_ran[marker]), "skipped": _skipped[marker]}
            for marker in _GUARDED
        }
        with open(path, "w") as f:
            json.dump({**report, "problems": problems}, f)
    if problems and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    for marker, backend in _GUARDED.items():
        tally = f"{backend}-backed tests: {len(_ran[marker])} ran, {len(_skipped[marker])} skipped"
        terminalreporter.write_sep("-", tally)
    for problem in _problems():
        terminalreporter.write_line(f"CI FAILURE: {problem}", red=True)
