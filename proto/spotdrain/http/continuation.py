"""Continuing a cut OpenAI stream on another worker, so the client never sees the seam.

Pure (no sockets, no aiohttp): a router keeps one `Transcript` per streamed request, passes it
every whole SSE block it relays (`relayed`), and when the stream is cut asks it for the body of
a continuation (`next_body`) to send to another worker, whose blocks it passes through
`relayed` as well. The algorithm (docs/api.md "Continuing a cut stream"):

- The transcript keeps the request, the text relayed so far and a count of completion tokens
  (one per chunk with text, or the worker's own count when its chunks carry `usage`).
- The gate's `interrupted` error event is held back, not relayed: the router either continues
  (the event is dropped) or ends the stream with it (`held_error`).
- A continuation asks for exactly what the uninterrupted generation would have produced next:
  `/v1/completions` gets the prompt with the text so far appended; `/v1/chat/completions` gets
  the messages plus an assistant message holding the text so far, with
  `continue_final_message: true` and `add_generation_prompt: false` (vLLM's parameters). Both
  ask for `max_tokens` (and `max_completion_tokens`) less what was produced, and for usage, so
  the next continuation can count as well.
- The continuation's chunks reach the client under the first response's `id`, `created` and
  `model`; its opening role-only chunk is dropped; a `usage` covers both parts: prompt tokens
  as the first request's (the continuation's less the tokens carried), completion tokens the
  carried plus the continuation's. Usage the client did not ask for is not passed on.

A request that cannot be continued faithfully (several choices, echo, a prompt that is not one
string, logprobs) gets no transcript: its cut is reported `interrupted`, as without this module.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PATHS = (COMPLETIONS, CHAT)

# Bounds on what a transcript holds: the text relayed is bounded by the worker's own output,
# but the router must not hold more than this for one request whatever the worker sends.
MAX_TEXT_CHARS = 4 << 20

_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


@dataclass(frozen=True)
class Carried:
    """What one continuation took over: for the `stream_continued` record and the logs."""

    chars: int
    tokens: int


class Transcript:
    """One streamed request as relayed so far. Build with `Transcript.of(path, body)`."""

    def __init__(self, path: str, request: dict[str, Any]) -> None:
        self.path = path
        self.request = request
        options = request.get("stream_options")
        self.client_usage = isinstance(options, dict) and options.get("include_usage") is True
        self.parts: list[str] = []
        self.chars = 0
        self.tokens = 0  # completion tokens relayed, all parts together
        self.id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.finished = False  # a choice's finish_reason went out: nothing is left to generate
        self.held_error = b""  # the gate's interrupted event, not relayed (yet)
        self.continuations = 0
        # Set while relaying a continuation: tokens carried into it, and the tokens it counts
        # from (its own count starts at 0).
        self._carried_tokens = 0
        self._opening = False  # the continuation's role-only first chunk is still to come

    @classmethod
    def of(cls, path: str, body: bytes) -> Transcript | None:
        """A transcript for a streamed request that can be continued; None otherwise."""
        if path not in PATHS:
            return None
        try:
            request = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(request, dict) or request.get("stream") is not True:
            return None
        if request.get("n", 1) != 1 or request.get("best_of", 1) not in (1, None):
            return None
        if request.get("logprobs") or request.get("echo"):
            return None  # the client would see the continuation's logprobs or prompt
        if path == COMPLETIONS:
            prompt = request.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                return None
            request["prompt"] = prompt
        else:
            messages = request.get("messages")
            if not isinstance(messages, list) or not messages:
                return None
        for name in _TOKEN_FIELDS:
            limit = request.get(name)
            if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)):
                return None
        return cls(path, request)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    # --- relaying ----------------------------------------------------------------------------

    def relayed(self, block: bytes) -> bytes:
        """One block of whole SSE events on its way to the client: recorded, and rewritten when
        it comes from a continuation. Returns the bytes to write (b"" for none)."""
        out: list[bytes] = []
        for event in _events(block):
            kept = self._event(event)
            if kept:
                out.append(kept)
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        lines = event.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        name = b""
        data: list[bytes] = []
        for line in lines:
            if line.startswith(b"event:"):
                name = line[6:].strip()
            elif line.startswith(b"data:"):
                data.append(line[5:].lstrip(b" "))
        payload = b"\n".join(data)
        if name == b"error" or b'"error"' in payload:
            doc = _json(payload)
            error = doc.get("error") if isinstance(doc, dict) else None
            if isinstance(error, dict) and error.get("type") == "interrupted":
                self.held_error = event
                return b""
            return event
        if not data or payload == b"[DONE]":
            return event
        doc = _json(payload)
        if not isinstance(doc, dict):
            return event
        if not self.continuations:
            self._chunk(doc)
            return event  # the first part goes byte for byte as the worker sent it
        if not self._chunk(doc):
            return b""
        return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

    def _chunk(self, doc: dict[str, Any]) -> bool:
        """Record one chunk, rewriting it in place when it is a continuation's; False to drop
        it."""
        if self.id is None:
            self.id, self.created, self.model = doc.get("id"), doc.get("created"), doc.get("model")
        elif self.continuations:
            doc["id"], doc["created"], doc["model"] = self.id, self.created, self.model
        choices = doc.get("choices")
        text = ""
        if isinstance(choices, list):
            for choice in choices:
                if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                    continue
                text = self._choice_text(choice)
                if choice.get("finish_reason"):
                    self.finished = True
        if text:
            self.chars += len(text)
            if self.chars <= MAX_TEXT_CHARS:
                self.parts.append(text)
            self.tokens += 1
        usage = doc.get("usage")
        if isinstance(usage, dict):
            self._usage(usage)
        if self.continuations and not self.client_usage:
            doc.pop("usage", None)
        if self._opening:
            self._opening = False
            if not text and not doc.get("usage") and not self.finished:
                return False  # the continuation's role-only opening: the client had one
        if self.continuations and not self.client_usage and isinstance(choices, list):
            if not choices:
                return False  # a usage chunk asked for by the router, not the client
        return True

    def _choice_text(self, choice: dict[str, Any]) -> str:
        if self.path == COMPLETIONS:
            text = choice.get("text")
        else:
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                return ""
            if self.continuations:
                delta.pop("role", None)
            text = delta.get("content")
        return text if isinstance(text, str) else ""

    def _usage(self, usage: dict[str, Any]) -> None:
        """A worker's usage: its completion count is the truth for its part; a continuation's is
        summed with what was carried into it."""
        completion = usage.get("completion_tokens")
        prompt = usage.get("prompt_tokens")
        if not _count(completion) or not _count(prompt):
            return
        self.tokens = self._carried_tokens + completion
        if self.continuations:
            # The continuation's prompt holds the carried text: count it as completion.
            usage["prompt_tokens"] = max(0, prompt - self._carried_tokens)
            usage["completion_tokens"] = self.tokens
            usage["total_tokens"] = usage["prompt_tokens"] + self.tokens

    # --- continuing --------------------------------------------------------------------------

    def remaining(self) -> int | None:
        """Tokens the continuation may produce (None: no limit was asked)."""
        limits = [self.request[n] for n in _TOKEN_FIELDS if self.request.get(n) is not None]
        return min(limits) - self.tokens if limits else None

    def continuable(self) -> str:
        """Why a continuation cannot be asked for (a short reason); "" when it can."""
        if self.finished:
            return "finished"
        if self.chars > MAX_TEXT_CHARS:
            return "too_long"
        if self.id is None:
            return "no_chunk"  # nothing to take the id from: the client saw no chunk
        remaining = self.remaining()
        if remaining is not None and remaining < 1:
            return "no_tokens_left"
        return ""

    def next_body(self) -> tuple[bytes, Carried]:
        """The body of the next continuation, and what it carries. Relay its stream through
        `relayed` from then on."""
        body = copy.deepcopy(self.request)
        text = self.text
        if self.path == COMPLETIONS:
            body["prompt"] = self.request["prompt"] + text
        else:
            messages = body["messages"]
            last = messages[-1]
            if (
                self.request.get("continue_final_message") is True
                and isinstance(last, dict)
                and last.get("role") == "assistant"
                and isinstance(last.get("content"), str)
            ):
                last["content"] += text  # the client was continuing a message already
            else:
                messages.append({"role": "assistant", "content": text})
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        for name in _TOKEN_FIELDS:
            if body.get(name) is not None:
                body[name] = body[name] - self.tokens
        options = body.get("stream_options")
        body["stream_options"] = {**(options if isinstance(options, dict) else {})}
        body["stream_options"]["include_usage"] = True
        self.continuations += 1
        self._carried_tokens = self.tokens
        self._opening = True
        self.held_error = b""
        return json.dumps(body).encode(), Carried(len(text), self.tokens)


def _events(block: bytes) -> list[bytes]:
    """Whole SSE events of a block (the relay writes whole events only), each with its blank
    line."""
    text = block.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return [e + b"\n\n" for e in text.split(b"\n\n") if e.strip(b"\n")]


def _json(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
