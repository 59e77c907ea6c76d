"""A node's cloud identity (CloudIdentity): the one check both sides apply, and how a person reads
it, the same in spotctl and the dashboard."""

from __future__ import annotations

from typing import Any

from spotdrain.protocol import limits
from spotdrain.v1 import spotdrain_pb2 as pb

PROVIDERS = ("aws", "gcp", "azure")
TEXT_FIELDS = ("provider", "instance_id", "region", "zone", "instance_type")


def problem(identity: dict[str, Any]) -> str | None:
    """What is wrong with an identity ({field: value} as CloudIdentity names them), naming the
    field, or None: every value printable and within limits.MAX_CLOUD_CHARS, the provider one
    of PROVIDERS or empty."""
    for key in TEXT_FIELDS:
        value = identity.get(key, "")
        if not isinstance(value, str):
            return f"{key} must be a string, got {type(value).__name__}"
        if len(value) > limits.MAX_CLOUD_CHARS or not value.isprintable():
            return (
                f"{key} must be printable and at most {limits.MAX_CLOUD_CHARS} characters, "
                f"got {value[:80]!r}"
            )
    if identity.get("provider", "") not in ("", *PROVIDERS):
        return (
            f"provider must be one of {', '.join(PROVIDERS)} or empty, got {identity['provider']!r}"
        )
    if not isinstance(identity.get("spot", False), bool):
        return "spot must be true or false"
    return None


def as_dict(c: pb.CloudIdentity) -> dict[str, Any]:
    return {key: getattr(c, key) for key in (*TEXT_FIELDS, "spot")}


def cloud_label(node: pb.Node) -> str:
    """`aws/us-east-1a/g5.xlarge/spot`: provider, where (the zone, or the region with Azure's
    bare zone number after it, or the region alone), type, spot or on-demand; `-` when the node
    never reported one. One word, so the table's columns stay split by spaces."""
    if not node.HasField("cloud"):
        return "-"
    c = node.cloud
    where = c.zone if c.zone.startswith(c.region) else f"{c.region}-{c.zone}"
    if not c.zone:
        where = c.region
    parts = (c.provider, where, c.instance_type, "spot" if c.spot else "on-demand")
    return "/".join(p or "?" for p in parts)
