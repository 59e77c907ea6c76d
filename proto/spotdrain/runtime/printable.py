"""Text from tenants and the wire made safe to show a person: on a terminal, in the journal.

A report's file name, a container's name, what a job wrote: any of it can hold ESC sequences
that rewrite an operator's terminal, BEL, a bidi override, or bytes that are not UTF-8. Every
human-readable output (spotctl's tables, the daemons' log lines) shows such text through
`printable`; JSON output needs nothing more, as JSON escapes control characters itself.
"""

from __future__ import annotations

# os.fsdecode and the "surrogateescape" handler carry each byte that is not UTF-8 as one lone
# surrogate in this range: U+DC80 + (byte - 0x80).
_ESCAPED_BYTES = range(0xDC80, 0xDD00)


def printable(text: str | bytes) -> str:
    """`text` with every character Python does not call printable written as an escape: C0
    and C1 controls, DEL, format characters such as bidi overrides, line and paragraph
    separators as `\\x1b`, `\\u009b`, `\\u202e`; a byte that was not UTF-8 (bytes given, or a
    surrogate-escaped str from the file system) as `\\xff`. Printable text comes back as it
    was, so escaping twice changes nothing."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ord(ch)) for ch in text)


def _escape(code: int) -> str:
    if code in _ESCAPED_BYTES:
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x80:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
