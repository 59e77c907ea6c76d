"""The suite keeps the shape docs/contributing.md ("Where a test goes") describes: every test
in a folder by concern, none loose at the top of tests/, and no two test files of one name
(pytest imports them by their base name: a second one of a name would not be collected)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FOLDERS = {"core", "common", "agent", "coordinator", "e2e", "repository", "fakes"}


def test_every_test_sits_in_a_folder_by_concern():
    files = sorted(TESTS.rglob("test_*.py"))
    assert files
    assert [
        f for f in files if f.parent.relative_to(TESTS).parts[:1] not in {(d,) for d in FOLDERS}
    ] == []


def test_no_two_test_files_share_a_name():
    names = Counter(f.name for f in TESTS.rglob("test_*.py"))
    assert [name for name, n in names.items() if n > 1] == []


def test_no_polling_helper_of_its_own():
    """One waiting helper (fakes.waiting): a test module that defines another one is a copy.
    (A recorder's own `until`, woken by an event rather than polling, is not one.)"""
    copies = [
        f"{f.relative_to(TESTS)}: {line.strip()}"
        for f in TESTS.rglob("test_*.py")
        for line in f.read_text().splitlines()
        if line.startswith(("async def until(", "async def eventually(", "def wait_until("))
    ]
    assert copies == []
