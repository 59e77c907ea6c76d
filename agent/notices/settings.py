"""The `[sources]` and `[advisory]` tables of agent.toml: which notice sources run, and what an
advisory does. Each source's own keys are checked by that source's `Config.from_table`.

`auto = true` (the default) reads the machine's DMI identity and turns on the one cloud it finds
with its defaults, plus `file` and `shutdown`; tables given are used as written on top.
`auto = false` runs exactly the tables given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotdrain.runtime.cli import UsageError

SOURCE_NAMES = ("file", "aws", "gcp", "azure", "shutdown")
ADVISORY_ACTIONS = ("prepare", "drain", "ignore")
MAX_TTL_S = 7 * 24 * 3600.0

# What each cloud writes into the DMI tables of its virtual machines (the files under
# /sys/class/dmi/id/): a file name and the prefix its content starts with.
DMI_SIGNS: dict[str, tuple[tuple[str, str], ...]] = {
    "aws": (("sys_vendor", "Amazon EC2"), ("board_asset_tag", "i-"), ("product_uuid", "ec2")),
    "gcp": (("product_name", "Google Compute Engine"), ("sys_vendor", "Google")),
    # Hyper-V says "Microsoft Corporation" on premises too: Azure alone sets this asset tag.
    "azure": (("chassis_asset_tag", "7783-7084-3265-9085-8269-3286-77"),),
}


@dataclass(frozen=True)
class AdvisoryPolicy:
    action: str = "prepare"  # prepare | drain | ignore
    ttl_s: float = 1800.0  # an advisory no notice follows is lifted after this


@dataclass(frozen=True)
class SourcesConfig:
    auto: bool = True
    dmi_dir: Path = Path("/sys/class/dmi/id")
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)  # as written in the file

    def names(self) -> list[str]:
        """The sources to run, in a stable order."""
        chosen = set(self.tables)
        if self.auto:
            chosen |= {"file", "shutdown"}
            cloud = detect_cloud(self.dmi_dir)
            if cloud:
                chosen.add(cloud)
        return [n for n in SOURCE_NAMES if n in chosen]


def detect_cloud(dmi_dir: Path) -> str:
    """The cloud whose signs the DMI directory shows, or "" (none, unreadable, or several)."""
    found = []
    for cloud, signs in DMI_SIGNS.items():
        for name, prefix in signs:
            try:
                text = (dmi_dir / name).read_text(errors="replace").strip()
            except OSError:
                continue
            if text.lower().startswith(prefix.lower()):
                found.append(cloud)
                break
    return found[0] if len(found) == 1 else ""


def parse_sources(doc: Any, where: str, only: str | None = None) -> SourcesConfig:
    """The [sources] table (missing: auto with defaults). `only`, from --sources, names the
    sources to run (comma-separated) and turns auto off."""
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise UsageError(f"{where}[sources] must be a table")
    doc = dict(doc)
    auto = doc.pop("auto", True)
    if not isinstance(auto, bool):
        raise UsageError(f"{where}sources.auto must be true or false")
    dmi_dir = doc.pop("dmi_dir", "/sys/class/dmi/id")
    if not isinstance(dmi_dir, str) or not dmi_dir:
        raise UsageError(f"{where}sources.dmi_dir must be a path")
    tables: dict[str, dict[str, Any]] = {}
    for name, table in doc.items():
        if name not in SOURCE_NAMES:
            raise UsageError(
                f"{where}unknown notice source sources.{name} (known: {', '.join(SOURCE_NAMES)})"
            )
        if not isinstance(table, dict):
            raise UsageError(f"{where}[sources.{name}] must be a table")
        tables[name] = table
    if only is not None:
        names = [n.strip() for n in only.split(",") if n.strip()]
        for name in names:
            if name not in SOURCE_NAMES:
                raise UsageError(
                    f"--sources: unknown source {name!r} (known: {', '.join(SOURCE_NAMES)})"
                )
        tables = {n: tables.get(n, {}) for n in names}
        auto = False
    if not auto and not tables:
        raise UsageError(
            f"{where}sources.auto is false and no [sources.NAME] table is given: "
            "the agent would hear no notice"
        )
    return SourcesConfig(auto=auto, dmi_dir=Path(dmi_dir), tables=tables)


def parse_advisory(doc: Any, where: str) -> AdvisoryPolicy:
    if doc is None:
        return AdvisoryPolicy()
    if not isinstance(doc, dict):
        raise UsageError(f"{where}[advisory] must be a table")
    unknown = sorted(set(doc) - {"action", "ttl_s"})
    if unknown:
        raise UsageError(f"{where}unknown setting advisory.{unknown[0]}")
    action = doc.get("action", "prepare")
    if action not in ADVISORY_ACTIONS:
        raise UsageError(
            f"{where}advisory.action must be one of {', '.join(ADVISORY_ACTIONS)}, got {action!r}"
        )
    ttl = number(doc.get("ttl_s", 1800.0), f"{where}advisory.ttl_s", 1.0, MAX_TTL_S)
    return AdvisoryPolicy(action=action, ttl_s=ttl)


def number(raw: Any, what: str, low: float, high: float) -> float:
    """A finite number within [low, high], or one clear UsageError."""
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise UsageError(f"{what} must be a number, got {raw!r}")
    value = float(raw)
    if not math.isfinite(value) or not low <= value <= high:
        raise UsageError(f"{what} must be between {low:g} and {high:g}, got {raw!r}")
    return value


def endpoint(raw: Any, what: str, default: str) -> str:
    """An http:// base URL with a host (no path beyond /), or one clear UsageError."""
    from urllib.parse import urlsplit  # noqa: PLC0415

    value = default if raw is None else raw
    if not isinstance(value, str):
        raise UsageError(f"{what} must be a URL string, got {value!r}")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as e:
        raise UsageError(f"{what} is not a URL: {value!r} ({e})") from None
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise UsageError(f"{what} must be http://HOST[:PORT], got {value!r}")
    if parts.query or parts.fragment or parts.username:
        raise UsageError(f"{what} must be http://HOST[:PORT], got {value!r}")
    del port
    return value.rstrip("/")


def check_keys(table: dict[str, Any], known: set[str], where: str, name: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise UsageError(f"{where}unknown setting sources.{name}.{unknown[0]}")
