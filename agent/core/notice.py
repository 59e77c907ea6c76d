"""The provider's notice, parsed: one normalised `Notice` or a `NoticeInvalid` with a reason.

Pure: bytes in, a value out. Every notice source (the file today, cloud relays later) goes
through here, so deduplication keys and validation are the same for all of them.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime

ACTIONS = ("terminate", "stop", "hibernate", "cancel")
MAX_ID_LEN = 256
# A deadline outside these years is a relay bug, not a plan.
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC).timestamp()
LATEST = datetime(2200, 1, 1, tzinfo=UTC).timestamp()


@dataclass(frozen=True)
class Notice:
    key: str  # idempotency key: the notice id, or a content hash when it has none
    notice_id: str  # what operators see: the id, or the key when there is no id
    action: str
    terminate_at: float | None  # epoch seconds; None means "T0 + default notice"
    source: str


@dataclass(frozen=True)
class NoticeInvalid:
    reason: str
    content_hash: str


def in_range(seconds: float) -> bool:
    """Whether an epoch time is one a provider can mean (finite, 2000 to 2200): every source
    checks its times here, so none can hand the machine a deadline it cannot store."""
    return math.isfinite(seconds) and EARLIEST <= seconds <= LATEST


def content_hash(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def parse_notice(raw: bytes) -> Notice | NoticeInvalid | None:
    """Parse the notice file's bytes. None means "no notice" (an empty or cleared file)."""
    if not raw.strip():
        return None
    digest = content_hash(raw.strip())

    def invalid(reason: str) -> NoticeInvalid:
        return NoticeInvalid(reason=reason, content_hash=digest)

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return invalid(f"not UTF-8 at byte {e.start}")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        return invalid(f"not JSON: {e.msg} at line {e.lineno} column {e.colno}")
    except RecursionError:
        return invalid("not JSON: nested too deeply")
    except ValueError as e:  # e.g. an integer beyond Python's digit limit
        return invalid(f"not JSON we accept: {e}")
    if not isinstance(doc, dict):
        return invalid(f"not a JSON object but {type(doc).__name__}")

    action = doc.get("action")
    if action not in ACTIONS:
        return invalid(f"action must be one of {', '.join(ACTIONS)}, got {_show(action)}")

    notice_id = doc.get("id")
    if notice_id is not None:
        if not isinstance(notice_id, str) or not notice_id.strip():
            return invalid(f"id must be a non-empty string, got {_show(notice_id)}")
        if len(notice_id) > MAX_ID_LEN:
            return invalid(f"id longer than {MAX_ID_LEN} characters")
        if not notice_id.isprintable():
            return invalid("id has control characters")

    if "terminate_at" in doc and "time" in doc:
        return invalid("both terminate_at and time given")
    # "time" is AWS's own instance-action document, accepted as is.
    field = "time" if "time" in doc else "terminate_at"
    terminate_at = None
    if field in doc:
        terminate_at, why = _parse_time(doc[field])
        if why:
            return invalid(f"{field} {why}")

    source = doc.get("source", "aws-instance-action" if field == "time" else "file")
    if not isinstance(source, str) or not source.isprintable() or len(source) > 128:
        return invalid(f"source must be a short string, got {_show(source)}")

    if action == "cancel" and notice_id is None:
        return invalid("a cancel notice needs the id of the notice it cancels")

    if notice_id is None:
        # No id: the same content is the same reclamation (docs/design.md "Hard notice timeline").
        # Hash the parsed document, so a relay that reformats the JSON is still the same.
        key = content_hash(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    else:
        key = "id:" + notice_id
    return Notice(
        key=key,
        notice_id=notice_id or key,
        action=action,
        terminate_at=terminate_at,
        source=source,
    )


def _parse_time(value: object) -> tuple[float | None, str | None]:
    if isinstance(value, bool):
        return None, f"must be a time, got {_show(value)}"
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:
            return None, f"is out of range: {_show(value)}"
    elif isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.strip())
        except ValueError:
            return None, f"is not an ISO 8601 time: {_show(value)}"
        if parsed.tzinfo is None:
            return None, f"has no time zone: {_show(value)}"
        seconds = parsed.timestamp()
    else:
        return None, f"must be an ISO 8601 string or epoch seconds, got {_show(value)}"
    if not in_range(seconds):
        return None, f"is out of range: {_show(value)}"
    return seconds, None


def _show(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**40:
        return f"an integer of {len(str(abs(value)))} digits"
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."
