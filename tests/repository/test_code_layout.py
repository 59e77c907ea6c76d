"""The product code keeps the shape docs/contributing.md ("Code map") describes: small modules,
small folders, nothing at the top of the shared package but the workload SDK. A module that
grows past the limit is split by concern, not given an exception here."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("agent", "coordinator", "proto")
MAX_LINES = 450
MAX_SDK_LINES = 500  # the workload SDK stays one file a workload may copy
MAX_MODULES = 12  # per folder, __init__.py included
SDK = REPO / "proto" / "spotdrain" / "workload.py"


def product_modules() -> list[Path]:
    """Every hand-written module (the generated stubs under v1/ are not ours to shape)."""
    return sorted(
        p
        for root in ROOTS
        for p in (REPO / root).rglob("*.py")
        if "v1" not in p.relative_to(REPO).parts and "__pycache__" not in p.parts
    )


def test_no_module_is_past_the_size_where_it_asks_to_be_split():
    modules = product_modules()
    assert SDK in modules
    too_long = {}
    for path in modules:
        lines = len(path.read_text().splitlines())
        if lines > (MAX_SDK_LINES if path == SDK else MAX_LINES):
            too_long[str(path.relative_to(REPO))] = lines
    assert too_long == {}


def test_no_folder_holds_more_than_a_dozen_modules():
    folders: dict[Path, int] = {}
    for path in product_modules():
        folders[path.parent] = folders.get(path.parent, 0) + 1
    assert {str(f.relative_to(REPO)): n for f, n in folders.items() if n > MAX_MODULES} == {}


def test_the_shared_package_holds_only_the_sdk_at_its_top():
    top = sorted(p.name for p in SDK.parent.glob("*.py"))
    assert top == ["__init__.py", "workload.py"]
