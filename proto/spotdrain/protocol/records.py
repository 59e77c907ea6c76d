"""Records read back from disk or the store, checked the same way by agent and coordinator."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def refuse_unknown_fields(doc: Mapping[str, Any], names: Iterable[str], what: str) -> None:
    """A record with a field this version does not know (a newer version's, or a corrupt one)
    is refused with its names, never read with the field dropped."""
    unknown = set(doc).difference(names)
    if unknown:
        raise ValueError(f"{what} has unknown fields {sorted(unknown)}")
