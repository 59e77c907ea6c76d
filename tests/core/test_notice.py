"""The notice file, parsed (docs/design.md "Interfaces: Notice file").

The relay writes the file atomically by rename, but a partial write, a relay bug or a stray
editor must never crash or mislead the agent: every input is a `Notice`, a `NoticeInvalid` with a
reason (a `notice_invalid` event and no action), or None (no notice at all).
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spotdrain.agent.core.notice import ACTIONS, Notice, NoticeInvalid, parse_notice

# The provider's deadline in the docs/design.md example: 2026-11-29T18:44:00Z.
D_2026 = datetime(2026, 11, 29, 18, 44, tzinfo=UTC).timestamp()


def sha256(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def canonical(raw: bytes) -> str:
    """The key of a notice without an id: the hash of its parsed, canonically dumped JSON."""
    doc = json.loads(raw)
    return sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())


# --- valid notices ---------------------------------------------------------------------------

AWS_INSTANCE_ACTION = b'{"action": "terminate", "time": "2026-11-29T18:44:00Z"}'
NO_DEADLINE = b'{"action": "terminate"}'

VALID = [
    pytest.param(
        b'{"id": "i-0abc-1732899000", "action": "terminate",'
        b' "terminate_at": "2026-11-29T18:44:00Z", "source": "aws-imds"}',
        Notice(
            key="id:i-0abc-1732899000",
            notice_id="i-0abc-1732899000",
            action="terminate",
            terminate_at=D_2026,
            source="aws-imds",
        ),
        id="design-example",
    ),
    pytest.param(
        b'{"id": "n-1", "action": "terminate", "terminate_at": %d}' % int(D_2026),
        Notice("id:n-1", "n-1", "terminate", D_2026, "file"),
        id="epoch-int",
    ),
    pytest.param(
        b'{"id": "n-1", "action": "terminate", "terminate_at": %.1f}' % (D_2026 + 0.5),
        Notice("id:n-1", "n-1", "terminate", D_2026 + 0.5, "file"),
        id="epoch-float",
    ),
    pytest.param(
        b'{"id": "n-1", "action": "terminate", "terminate_at": "2026-11-29T20:44:00+02:00"}',
        Notice("id:n-1", "n-1", "terminate", D_2026, "file"),
        id="offset-plus-two",
    ),
    pytest.param(
        AWS_INSTANCE_ACTION,
        Notice(
            key=canonical(AWS_INSTANCE_ACTION),
            notice_id=canonical(AWS_INSTANCE_ACTION),
            action="terminate",
            terminate_at=D_2026,
            source="aws-instance-action",
        ),
        id="aws-instance-action-as-is",
    ),
    pytest.param(
        NO_DEADLINE,
        Notice(canonical(NO_DEADLINE), canonical(NO_DEADLINE), "terminate", None, "file"),
        id="no-terminate-at-means-default-notice",
    ),
    pytest.param(
        b'{"id": "n-2", "action": "stop", "terminate_at": "2026-11-29T18:44:00Z"}',
        Notice("id:n-2", "n-2", "stop", D_2026, "file"),
        id="stop",
    ),
    pytest.param(
        b'{"id": "n-3", "action": "hibernate", "time": "2026-11-29T18:44:00Z"}',
        Notice("id:n-3", "n-3", "hibernate", D_2026, "aws-instance-action"),
        id="hibernate",
    ),
    pytest.param(
        b'{"id": "i-0abc-1732899000", "action": "cancel", "source": "aws-imds"}',
        Notice("id:i-0abc-1732899000", "i-0abc-1732899000", "cancel", None, "aws-imds"),
        id="cancel-with-id",
    ),
    pytest.param(
        b'{"id": "n-4", "action": "terminate", "terminate_at": "2026-11-29T18:44:00Z",'
        b' "region": "eu-west-1", "detail": {"az": ["a", 1, null]}, "version": 3}',
        Notice("id:n-4", "n-4", "terminate", D_2026, "file"),
        id="unknown-fields-ignored",
    ),
    pytest.param(
        b'\n  {"id": "n-5", "action": "terminate"}\n\n',
        Notice("id:n-5", "n-5", "terminate", None, "file"),
        id="surrounding-whitespace",
    ),
]


@pytest.mark.parametrize(("raw", "expected"), VALID)
def test_a_valid_notice_is_normalised(raw: bytes, expected: Notice) -> None:
    """Whatever the relay or the provider wrote, the agent sees one normalised Notice."""
    assert parse_notice(raw) == expected


def test_the_idempotency_key_is_the_id_when_there_is_one() -> None:
    """Two writes of the same notice id, even with different bodies, are one reclamation."""
    first = parse_notice(b'{"id": "i-9", "action": "terminate", "terminate_at": 1795977840}')
    again = parse_notice(b'{"action": "terminate", "id": "i-9", "source": "relay-2"}')
    assert isinstance(first, Notice) and isinstance(again, Notice)
    assert first.key == again.key == "id:i-9"


def test_without_an_id_the_same_bytes_are_the_same_reclamation() -> None:
    """The relay rewrites AWS's document on every poll: the same content is one reclamation."""
    first = parse_notice(AWS_INSTANCE_ACTION)
    again = parse_notice(AWS_INSTANCE_ACTION + b"\n")  # a trailing newline is not new content
    later = parse_notice(b'{"action": "terminate", "time": "2026-11-29T18:46:00Z"}')
    assert isinstance(first, Notice) and isinstance(again, Notice) and isinstance(later, Notice)
    assert first.key == again.key == canonical(AWS_INSTANCE_ACTION)
    assert later.key != first.key
    # Reformatted by another relay (keys reordered, no spaces): still the same reclamation.
    reformatted = parse_notice(b'{"time":"2026-11-29T18:44:00Z","action":"terminate"}')
    assert isinstance(reformatted, Notice) and reformatted.key == first.key
    # A hash can never be taken for an id, nor an id for a hash.
    assert first.key.startswith("sha256:") and not first.key.startswith("id:")


# --- malformed notices -----------------------------------------------------------------------


def terminate(**fields: object) -> bytes:
    return json.dumps({"id": "n-1", "action": "terminate", **fields}).encode()


MALFORMED = [
    pytest.param(b'{"id": "n-1", "action": "terminate\xff"}', "not UTF-8 at byte", id="not-utf8"),
    pytest.param(b"terminate now please", "not JSON", id="not-json"),
    pytest.param(b'{"id": "i-0abc", "action": "termin', "not JSON", id="partial-write"),
    pytest.param(b'{"id": "i-0abc", "action": "terminate",', "not JSON", id="partial-write-2"),
    pytest.param(b'["terminate"]', "not a JSON object but list", id="array"),
    pytest.param(b"1795977840", "not a JSON object but int", id="number"),
    pytest.param(b'"terminate"', "not a JSON object but str", id="string"),
    pytest.param(b"null", "not a JSON object", id="null"),
    pytest.param(
        b'{"id": "n-1"}',
        "action must be one of terminate, stop, hibernate, cancel, got null",
        id="missing-action",
    ),
    pytest.param(b'{"id": "n-1", "action": "reboot"}', 'got "reboot"', id="unknown-action"),
    pytest.param(b'{"id": "n-1", "action": "TERMINATE"}', 'got "TERMINATE"', id="action-case"),
    pytest.param(
        b'{"id": 42, "action": "terminate"}',
        "id must be a non-empty string, got 42",
        id="id-not-string",
    ),
    pytest.param(
        b'{"id": "", "action": "terminate"}', "id must be a non-empty string", id="id-empty"
    ),
    pytest.param(
        b'{"id": "   ", "action": "terminate"}', "id must be a non-empty string", id="id-blank"
    ),
    pytest.param(
        json.dumps({"id": "x" * 257, "action": "terminate"}).encode(),
        "id longer than 256 characters",
        id="id-too-long",
    ),
    pytest.param(
        b'{"id": "i-1\\n", "action": "terminate"}', "id has control characters", id="id-newline"
    ),
    pytest.param(
        b'{"id": "i-\\u001b[31m", "action": "terminate"}',
        "id has control characters",
        id="id-escape-sequence",
    ),
    pytest.param(
        terminate(terminate_at=True),
        "terminate_at must be a time, got true",
        id="terminate-at-bool",
    ),
    pytest.param(
        terminate(terminate_at={"at": 1795977840}),
        "terminate_at must be an ISO 8601 string or epoch seconds",
        id="terminate-at-object",
    ),
    pytest.param(
        terminate(terminate_at=[1795977840]),
        "terminate_at must be an ISO 8601 string or epoch seconds",
        id="terminate-at-list",
    ),
    pytest.param(
        terminate(terminate_at="2026-11-29T18:44:00"),
        "terminate_at has no time zone",
        id="naive-time",
    ),
    pytest.param(
        terminate(terminate_at="soon"),
        'terminate_at is not an ISO 8601 time: "soon"',
        id="garbage-time",
    ),
    pytest.param(
        terminate(terminate_at=""), "terminate_at is not an ISO 8601 time", id="empty-time"
    ),
    pytest.param(
        b'{"action": "terminate", "terminate_at": NaN}',
        "terminate_at is out of range: nan",
        id="nan",
    ),
    pytest.param(
        b'{"action": "terminate", "terminate_at": Infinity}',
        "terminate_at is out of range: inf",
        id="infinity",
    ),
    pytest.param(
        b'{"action": "terminate", "terminate_at": -Infinity}',
        "terminate_at is out of range: -inf",
        id="minus-infinity",
    ),
    pytest.param(
        b'{"action": "terminate", "terminate_at": 1e400}',
        "terminate_at is out of range",
        id="float-overflows-to-infinity",
    ),
    pytest.param(
        terminate(terminate_at="1970-01-01T00:02:00Z"),
        "terminate_at is out of range",
        id="year-1970",
    ),
    pytest.param(terminate(terminate_at=120), "terminate_at is out of range: 120", id="epoch-120"),
    pytest.param(
        terminate(terminate_at=1795977840000),
        "terminate_at is out of range",
        id="epoch-milliseconds",
    ),
    pytest.param(
        terminate(terminate_at="3000-01-01T00:00:00Z"),
        "terminate_at is out of range",
        id="year-3000",
    ),
    pytest.param(
        b'{"action": "terminate", "time": "2026-11-29T18:44:00Z",'
        b' "terminate_at": "2026-11-29T18:44:00Z"}',
        "both terminate_at and time given",
        id="time-and-terminate-at",
    ),
    pytest.param(
        b'{"action": "terminate", "time": "tomorrow"}',
        "time is not an ISO 8601 time",
        id="aws-time-garbage",
    ),
    pytest.param(b'{"action": "cancel"}', "a cancel notice needs the id", id="cancel-without-id"),
    pytest.param(terminate(source=7), "source must be a short string, got 7", id="source-number"),
    pytest.param(
        terminate(source=None), "source must be a short string, got null", id="source-null"
    ),
    pytest.param(terminate(source="x" * 129), "source must be a short string", id="source-long"),
]


@pytest.mark.parametrize(("raw", "fragment"), MALFORMED)
def test_a_malformed_notice_is_invalid_with_a_reason(raw: bytes, fragment: str) -> None:
    """A bad notice is a notice_invalid event that says why, and no action."""
    result = parse_notice(raw)
    assert isinstance(result, NoticeInvalid), result
    assert fragment in result.reason
    assert result.content_hash == sha256(raw.strip())


def test_an_absurdly_large_integer_deadline_is_invalid_not_a_crash() -> None:
    """A relay bug writes a 400-digit epoch: the agent must say so, not die."""
    result = parse_notice(b'{"action": "terminate", "terminate_at": 1' + b"0" * 400 + b"}")
    assert isinstance(result, NoticeInvalid)


def test_an_integer_beyond_the_conversion_limit_is_invalid_not_a_crash() -> None:
    """A corrupted file holding 5000 digits is 'not JSON we accept', never an exception."""
    result = parse_notice(b'{"action": "terminate", "terminate_at": ' + b"7" * 5000 + b"}")
    assert isinstance(result, NoticeInvalid)


@pytest.mark.parametrize("raw", [b"", b" ", b"\n", b" \t\r\n  \n"])
def test_an_empty_or_cleared_file_is_no_notice(raw: bytes) -> None:
    """The relay truncates the file when the provider withdraws nothing: that is not a notice."""
    assert parse_notice(raw) is None


# --- properties ------------------------------------------------------------------------------

# Integers are bounded to keep examples readable; huge ones have tests of their own above.
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(ACTIONS)
    | st.sampled_from(["2026-11-29T18:44:00Z", "2026-11-29T18:44:00", "2026-11-29T20:44+02:00"])
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)
notice_shaped = st.fixed_dictionaries(
    {},
    optional={
        "id": json_values | st.text(max_size=300),
        "action": st.sampled_from(ACTIONS) | json_values,
        "terminate_at": json_values | st.floats(min_value=9e8, max_value=8e9),
        "time": json_values | st.datetimes(timezones=st.timezones()).map(datetime.isoformat),
        "source": json_values,
        "extra": json_values,
    },
)


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash_the_parser(raw: bytes) -> None:
    """Whatever lands in the notice file, the agent keeps running."""
    assert isinstance(parse_notice(raw), Notice | NoticeInvalid | type(None))


@settings(max_examples=300)
@given(json_values | notice_shaped)
def test_arbitrary_json_is_a_notice_only_when_it_is_an_object_with_a_known_action(
    value: object,
) -> None:
    """Only a JSON object with one of the four actions can ever start or cancel a reclamation."""
    raw = json.dumps(value).encode()
    result = parse_notice(raw)
    assert isinstance(result, Notice | NoticeInvalid)  # JSON text is never blank
    if isinstance(result, Notice):
        assert isinstance(value, dict)
        assert value["action"] in ACTIONS and result.action == value["action"]
        if value.get("id") is not None:
            assert result.key == "id:" + value["id"] and result.notice_id == value["id"]
        else:
            assert result.key == result.notice_id == canonical(raw)
        if result.terminate_at is not None:
            assert datetime(2000, 1, 1, tzinfo=UTC).timestamp() - 86400 <= result.terminate_at
            assert result.terminate_at <= datetime(2200, 1, 1, tzinfo=UTC).timestamp() + 86400
    else:
        assert result.reason and result.content_hash == sha256(raw)


@given(notice_shaped)
def test_the_same_bytes_always_parse_the_same(value: object) -> None:
    """A notice rewritten unchanged is the same reclamation (or the same complaint)."""
    raw = json.dumps(value).encode()
    assert parse_notice(raw) == parse_notice(raw)
