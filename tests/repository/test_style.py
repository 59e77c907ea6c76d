"""The style is checked, not only described (docs/contributing.md "Style"): ruff's rules and its
formatter over the whole repository, and mypy --strict over the pure cores, whose types are
their documentation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# The rules of the node and of the fleet, and what both sides agree on: typed strictly.
STRICT_PACKAGES = ("spotdrain.agent.core", "spotdrain.coordinator.core", "spotdrain.protocol")


def run(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing():
    result = run(str(BIN / "ruff"), "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_file_is_as_ruff_formats_it():
    result = run(str(BIN / "ruff"), "format", "--check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def package_tree(root: Path) -> Path:
    """`spotdrain` laid out as it is installed, from links: proto/spotdrain's modules, with agent/
    and coordinator/ under it (pyproject.toml's package-dir)."""
    tree = root / "spotdrain"
    tree.mkdir()
    for child in (REPO / "proto" / "spotdrain").iterdir():
        if child.name != "__pycache__":
            (tree / child.name).symlink_to(child)
    (tree / "agent").symlink_to(REPO / "agent")
    (tree / "coordinator").symlink_to(REPO / "coordinator")
    return root


def test_the_pure_cores_type_check_strictly(tmp_path):
    root = package_tree(tmp_path)
    packages = [arg for name in STRICT_PACKAGES for arg in ("-p", name)]
    config = ("--config-file", str(REPO / "pyproject.toml"), "--cache-dir", str(tmp_path / "c"))
    result = run(
        str(BIN / "mypy"), "--strict", *config, "--follow-imports=silent", *packages, cwd=root
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout
