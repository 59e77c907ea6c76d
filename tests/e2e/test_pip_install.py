"""A new user installs spotdrain with pip, as README's "Install" says: a clean virtual
environment (`python3 -m venv`), `pip install <checkout>`, and the commands answer. On a fresh
machine there is no C compiler, no pkg-config and no libsystemd-dev, so this machine's are
hidden behind shims that fail: a dependency that builds from source (as systemd-python did, for
the journal) fails the install here as it would there.

It uses pip's configured index and cache, like the user would; nothing else is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What a toolchain or a -dev package would answer to; each shim fails loudly instead.
HIDDEN_TOOLS = (
    "cc",
    "gcc",
    "c++",
    "g++",
    "x86_64-linux-gnu-gcc",
    "aarch64-linux-gnu-gcc",
    "pkg-config",
    "x86_64-linux-gnu-pkg-config",
    "aarch64-linux-gnu-pkg-config",
)


def clone_tree(dest: Path) -> Path:
    """The files a clone would have (tracked, plus new files not ignored), copied: the build
    then sees what a clone sees, and writes nothing into the shared checkout."""
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
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def no_toolchain(bin_dir: Path) -> dict[str, str]:
    """An environment where compilers and pkg-config exist only as shims that fail."""
    bin_dir.mkdir()
    for tool in HIDDEN_TOOLS:
        shim = bin_dir / tool
        shim.write_text(f"#!/bin/sh\necho '{tool}: not on a fresh machine' >&2\nexit 1\n")
        shim.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
    env["CC"] = str(bin_dir / "cc")
    env["CXX"] = str(bin_dir / "c++")
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    return env


def system_python() -> str:
    """The python3 a user would type: the one this venv was made from."""
    return shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or sys._base_executable


def test_pip_install_in_a_clean_venv_needs_no_compiler_and_no_libsystemd(tmp_path):
    """README's three lines, on a machine without a compiler or libsystemd-dev: the install
    succeeds, every command answers --help, and the journal binding that needed compiling
    is not among what was installed."""
    env = no_toolchain(tmp_path / "shims")
    source = clone_tree(tmp_path / "spotdrain")
    venv = tmp_path / "venv"
    subprocess.run([system_python(), "-m", "venv", str(venv)], check=True, env=env, timeout=120)
    install = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--disable-pip-version-check", str(source)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    for command in ("spotdrain-agent", "spotdrain-coordinator", "spotctl", "spotdrain-router"):
        answer = subprocess.run(
            [str(venv / "bin" / command), "--help"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert answer.returncode == 0, (command, answer.stderr)
        assert "usage:" in answer.stdout, (command, answer.stdout)
    # pip's cache may hold a wheel compiled here earlier (systemd-python's, from before), which
    # would install without a compiler: every platform wheel must be a published one.
    built_here = [
        f"{wheel.parent.name}: {tag}"
        for wheel in venv.glob("lib/python3*/site-packages/*.dist-info/WHEEL")
        for tag in wheel.read_text().splitlines()
        if tag.startswith("Tag:") and tag.endswith(("-linux_x86_64", "-linux_aarch64"))
    ]
    assert built_here == [], "compiled at install time, needs a toolchain: " + str(built_here)
    found = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.util, spotdrain.runtime.systemd; "
            "print(importlib.util.find_spec('systemd'))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert found.stdout.strip() == "None", "systemd-python was installed: " + found.stdout
