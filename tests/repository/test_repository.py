"""The repository stands alone, and its documentation stays true to the code.

A clone has only what git gives it: nothing may point at a sibling checkout or a developer's
machine. Comments cite docs/design.md by section, step and invariant number: each must exist.
Every agent setting and coordinator flag, read from the code, must be in docs/configuration.md,
so a new one shows up here until it is documented. Every command and spotctl verb answers
--help.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from fakes.harness import BIN
from spotdrain.agent import config as agent_config
from spotdrain.agent.notices import MODULES, module
from spotdrain.agent.spotctl import main as spotctl
from spotdrain.coordinator import main as coordinator_main

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

# Roots of a developer's machine rather than of the system a clone runs on: /run, /etc, /var,
# /usr, /opt, /sys, /proc, /dev, /tmp and the like stay allowed.
DEVELOPER_ROOTS = ("home", "root", "Users", "work", "workspace", "mnt", "media")
# A path token starts after a boundary: not inside a word, a URL, another path or a variable.
_BOUNDARY = r"(?<![\w.:/$}\-])"
ABSOLUTE_DEVELOPER_PATH = re.compile(_BOUNDARY + "/(?:" + "|".join(DEVELOPER_ROOTS) + r")/")
PARENT_PATH = re.compile(_BOUNDARY + r"((?:\.\./)+)([\w.-]*)")
# The team's notes live outside the repository; the repository has its own docs/.
# (The pattern is built from its parts, so this file does not name the path it looks for.)
NOTES_OUTSIDE = re.compile(r"\b" + "shared" + r"/(?:DESIGN|STYLE)\.md")


@cache
def repository_files() -> tuple[Path, ...]:
    """What a clone has once the work in progress is committed: tracked files and new ones
    that are not ignored."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    return tuple(REPO / name for name in listed if name and (REPO / name).is_file())


@cache
def text_of(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None  # binary
    return data.decode("utf-8", "replace")


def texts() -> list[tuple[Path, str]]:
    return [(p, t) for p in repository_files() if (t := text_of(p)) is not None]


def escapes(path: Path, dots: str, rest: str) -> bool:
    """Whether `dots` + `rest`, read from `path`'s directory, leaves the repository."""
    target = (path.parent / dots / rest).resolve()
    return not target.is_relative_to(REPO)


def outside_references(path: Path, text: str) -> list[str]:
    found = []
    checkout = str(REPO)
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{path.relative_to(REPO)}:{number}"
        found += [f"{where}: {m.group(0)}" for m in ABSOLUTE_DEVELOPER_PATH.finditer(line)]
        found += [f"{where}: {m.group(0)}" for m in NOTES_OUTSIDE.finditer(line)]
        found += [
            f"{where}: {m.group(0)}"
            for m in PARENT_PATH.finditer(line)
            if escapes(path, m.group(1), m.group(2))
        ]
        if checkout in line:
            found.append(f"{where}: {checkout}")
    return found


def test_no_file_refers_to_a_path_outside_the_repository():
    """A fresh clone has no sibling checkout of the team's notes, and no developer's home or
    work directory: every path a file names is inside the repository or a system path (/run,
    /etc, /usr, ...)."""
    found = [ref for path, text in texts() for ref in outside_references(path, text)]
    assert found == []


def test_the_outside_check_sees_what_it_must(tmp_path):
    """The patterns the check above relies on, tried on lines that must and must not count."""
    readme = REPO / "README.md"
    bench = REPO / "tests" / "bench" / "README.md"
    flagged = {
        "see ../" + "shared/" + "DESIGN.md": readme,
        "see `" + "../" * 3 + "shared/x`": bench,
        "in shared/" + "STYLE.md": readme,
        "cd /" + "work/main": readme,
        "at /" + "home/dev/spotdrain": readme,
        f"from {REPO}/proto": readme,
    }
    allowed = {
        "/run/spotdrain/notice.json and /etc/spotdrain/agent.toml": readme,
        "unix:///run/docker.sock, https://systemd.io/x/": readme,
        'repo="$(cd "$(dirname "$0")/../.." && pwd)"': bench,
        "../proto/spotdrain/v1/spotdrain.proto": bench,
        "../" * 2 + "shared/inside-the-repository": bench,
        "py=$here/../.venv/bin/python": readme,
        ".../instancedata-data-retrieval.html": readme,
    }
    assert [line for line, path in flagged.items() if not outside_references(path, line)] == []
    assert {line: outside_references(path, line) for line, path in allowed.items()} == {
        line: [] for line in allowed
    }


# --- references into docs/ -------------------------------------------------------------------

DOC_FILE = re.compile(r"\bdocs/([\w-]+\.md)\b")
# A page, then a quoted section name: also with a comma, colon or parenthesis between, and
# across a line break in a comment (see `joined`).
DOC_SECTION = re.compile(r"\bdocs/(?P<doc>[\w-]+\.md)[\s,:(]{0,3}\"(?P<section>[^\"]{1,80})\"")
# Inside docs/: a markdown link to a page, then a quoted section name.
LINK_SECTION = re.compile(r"\]\((?P<doc>[\w-]+\.md)\)\s{1,3}\"(?P<section>[^\"]{1,80})\"")
LINK = re.compile(r"\]\((?:docs/)?(?P<doc>[\w-]+\.md)(?:#[\w-]*)?\)")
INVARIANT = re.compile(r"\binvariants? (\d+)(?:,? and (\d+))?")
STEP = re.compile(r"\bdocs/design\.md[^\"\n]{0,20}?\bsteps? (\d+)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)


def joined(text: str) -> str:
    """Lines joined with their comment markers dropped, so a quoted section name that a comment
    wraps onto the next line reads whole."""
    return re.sub(r"[ \t]*\n[ \t]*(?:#+|//+|\*|\"\"\")?[ \t]*", " ", text)


def headings(doc: str) -> set[str]:
    return {h.strip("`").casefold() for h in HEADING.findall((DOCS / doc).read_text())}


def numbered_items(doc: str, heading: str) -> list[int]:
    text = (DOCS / doc).read_text()
    section = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, f"docs/{doc} has no section {heading!r}"
    return [int(n) for n in re.findall(r"^(\d+)\. ", section.group(1), re.M)]


def invariants() -> list[int]:
    return numbered_items("design.md", "Invariants")


def timeline_steps() -> set[int]:
    text = (DOCS / "design.md").read_text()
    section = re.search(r"^## Hard notice timeline\n(.*?)(?=^## )", text, re.M | re.S)
    assert section, "docs/design.md has no section 'Hard notice timeline'"
    steps: set[int] = set()
    for first, last in re.findall(r"^\| (\d+)(?:-(\d+))? \|", section.group(1), re.M):
        steps.update(range(int(first), int(last or first) + 1))
    return steps


def section_references() -> list[tuple[str, str, str]]:
    """(where, doc, section) for every quoted section reference in the repository."""
    refs = []
    for path, text in texts():
        where = str(path.relative_to(REPO))
        flat = joined(text)
        refs += [(where, m["doc"], m["section"]) for m in DOC_SECTION.finditer(flat)]
        if path.parent == DOCS:
            refs += [(where, m["doc"], m["section"]) for m in LINK_SECTION.finditer(flat)]
    return refs


def test_every_referenced_doc_exists():
    """A docs/<page>.md anywhere, and every link between the pages, names a file that exists."""
    missing = []
    for path, text in texts():
        names = set(DOC_FILE.findall(text))
        if path.parent == DOCS or path == REPO / "README.md":
            names |= {m["doc"] for m in LINK.finditer(text)}
        missing += [
            f"{path.relative_to(REPO)}: {n}" for n in sorted(names) if not (DOCS / n).is_file()
        ]
    assert missing == []


def test_every_referenced_section_exists():
    """A page named with a quoted section after it ("Hard notice timeline"; "Interfaces: Notice
    file" is a heading and one under it): each part names a heading of that page."""
    assert len(section_references()) > 30, "the reference pattern no longer matches the code"
    missing = [
        f"{where}: docs/{doc} {section!r}"
        for where, doc, section in section_references()
        if not (DOCS / doc).is_file()
        or any(part.casefold() not in headings(doc) for part in section.split(": "))
    ]
    assert missing == []


def test_invariants_are_numbered_one_to_ten_and_every_cited_one_exists():
    numbers = invariants()
    assert numbers == list(range(1, 11))
    cited = [
        (str(path.relative_to(REPO)), int(n))
        for path, text in texts()
        for m in INVARIANT.finditer(joined(text))
        for n in m.groups()
        if n is not None
    ]
    assert len(cited) > 20, "the invariant pattern no longer matches the code"
    assert [(where, n) for where, n in cited if n not in numbers] == []


def test_every_cited_step_is_in_the_hard_notice_timeline():
    steps = timeline_steps()
    assert {2, 3, 4, 6, 10, 13} <= steps
    cited = [
        (str(path.relative_to(REPO)), int(m.group(1)))
        for path, text in texts()
        for m in STEP.finditer(joined(text))
    ]
    assert cited, "the step pattern no longer matches the code"
    assert [(where, n) for where, n in cited if n not in steps] == []


def test_contributing_has_the_words_section():
    """Code cites docs/contributing.md "Words" for the naming and logging rules."""
    assert "words" in headings("contributing.md")


# --- every setting documented ------------------------------------------------------------------


def flags(parser: argparse.ArgumentParser) -> list[str]:
    return [
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    ]


def configuration_doc() -> str:
    return (DOCS / "configuration.md").read_text()


def test_every_agent_setting_is_in_configuration_md():
    """Every key of agent.toml (spotdrain.agent.config: SETTINGS, the [margins] table, insecure
    and spot) and every flag of spotdrain-agent, as the code defines them today."""
    doc = configuration_doc()
    keys = [*agent_config.SETTINGS, "insecure", "spot"]
    keys += [f"margins.{name}" for name in agent_config.MARGINS]
    keys += ["sources.auto", "sources.dmi_dir", "advisory.action", "advisory.ttl_s"]
    for source in MODULES:  # each notice source's own table, from its Config
        keys += [f"sources.{source}.{f.name}" for f in dataclasses.fields(module(source).Config)]
    assert len(keys) > 25
    missing = [key for key in keys if f"`{key}`" not in doc]
    missing += [
        flag
        for flag in flags(agent_config.parser())
        if not re.search(rf"`{re.escape(flag)}[` ]", doc)
    ]
    assert missing == []


def test_every_coordinator_flag_is_in_configuration_md():
    doc = configuration_doc()
    coordinator_flags = flags(coordinator_main.parser())
    assert {"--listen", "--db", "--client-ca"} <= set(coordinator_flags)
    assert [f for f in coordinator_flags if not re.search(rf"`{re.escape(f)}[` ]", doc)] == []


# --- every command answers --help --------------------------------------------------------------


def spotctl_verbs(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from spotctl_verbs(sub, (*prefix, name))


COMMANDS = [
    ("spotdrain-agent",),
    ("spotdrain-coordinator",),
    ("spotdrain-router",),
    ("spotctl",),
    *(("spotctl", *verb) for verb in spotctl_verbs(spotctl.parser())),
]


def test_spotctl_has_the_verbs_we_document():
    verbs = {" ".join(c[1:]) for c in COMMANDS if c[0] == "spotctl"}
    assert {
        "pause",
        "resume",
        "status",
        "events",
        "timeline",
        "workers start",
        "rentals watch",
        "models set-replicas",
        "node set-spot",
    } <= verbs


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_answers_help(command):
    """Installed scripts (.venv/bin, as a user runs them): --help exits 0 with a usage line."""
    answer = subprocess.run(
        [str(BIN / command[0]), *command[1:], "--help"], capture_output=True, text=True, timeout=60
    )
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.startswith("usage: " + " ".join(command)), answer.stdout[:200]
