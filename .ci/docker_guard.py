"""pytest plugin for CI: Docker-backed tests must run, never be skipped (shared/DESIGN.md).

Loaded by .ci/run with `-p docker_guard`. Tests marked `docker` that were skipped, or no such
test running at all, fail the session. The tally is written as JSON to $SPOTDRAIN_CI_REPORT so
.ci/run can check it independently of pytest's exit code.
"""

from __future__ import annotations

import json
import os

import pytest

_ran: set[str] = set()
_skipped: dict[str, str] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "docker" not in report.keywords or hasattr(report, "wasxfail"):
        return
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped[report.nodeid] = reason
    elif report.when == "call":
        _ran.add(report.nodeid)


def _problems() -> list[str]:
    problems = [f"docker test skipped: {nodeid}: {reason}" for nodeid, reason in _skipped.items()]
    if not _ran:
        problems.append("no Docker-backed test ran")
    return problems


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    problems = _problems()
    path = os.environ.get("SPOTDRAIN_CI_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"ran": sorted(_ran), "skipped": _skipped, "problems": problems}, f)
    if problems and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    tally = f"docker-backed tests: {len(_ran)} ran, {len(_skipped)} skipped"
    terminalreporter.write_sep("-", tally)
    for problem in _problems():
        terminalreporter.write_line(f"CI FAILURE: {problem}", red=True)
