"""The continuation of a cut stream (spotdrain.http.continuation), on its own: what a router
relays of a first part and its continuation, and the body it asks the second worker for.

The worker here is the reference model server's own generation (tests/images/fake_model), so
"the whole text equals one uninterrupted generation" is checked against the same function the
container runs."""

from __future__ import annotations

import json
from typing import Any

import pytest

from images.fake_model.server import _token, continuation_of, render
from spotdrain.http.continuation import CHAT, COMPLETIONS, Carried, Transcript

ID, CREATED, MODEL = "chatcmpl-first", 1700000000, "fake-model"
INTERRUPTED = (
    b'event: error\ndata: {"error": {"type": "interrupted", "message": "stopped", '
    b'"request_id": "r1"}}\n\n'
)


def sse(doc: dict[str, Any] | str) -> bytes:
    payload = doc if isinstance(doc, str) else json.dumps(doc)
    return f"data: {payload}\n\n".encode()


def worker_stream(
    path: str, body: dict[str, Any], *, id_: str, cut_after: int | None = None
) -> list[bytes]:
    """What the reference model server streams for `body`, one block per event; with cut_after,
    the gate's cut after that many tokens instead of the end."""
    chat = path == CHAT
    continued = body.get("continue_final_message") is True
    prompt = render(body["messages"], continued, not continued) if chat else body["prompt"]
    head, seed, first = continuation_of(prompt)
    usage_asked = (body.get("stream_options") or {}).get("include_usage") is True

    def chunk(text: str | None, finish: str | None = None, role: bool = False) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                choice["delta"]["content"] = text
        else:
            choice["text"] = text or ""
        out = {"id": id_, "created": CREATED + first, "model": "served-" + id_}
        out["choices"] = [choice]
        if usage_asked:
            out["usage"] = None
        return out

    blocks = [sse(chunk(None, role=True))] if chat else []
    n = body["max_tokens"]
    for i in range(n):
        if cut_after is not None and i == cut_after:
            return [*blocks, INTERRUPTED]
        blocks.append(sse(chunk(_token(seed, first + i))))
    blocks.append(sse(chunk(None, "stop")))
    if usage_asked:
        prompt_tokens = len(head.split()) + first
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n}
        usage["total_tokens"] = prompt_tokens + n
        blocks.append(sse({"id": id_, "choices": [], "usage": usage}))
    blocks.append(sse("[DONE]"))
    return blocks


def parse(stream: bytes) -> list[dict[str, Any] | str]:
    out: list[dict[str, Any] | str] = []
    for event in stream.split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data: "):
                data = line[6:].decode()
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def text_of(path: str, events: list[dict[str, Any] | str]) -> str:
    key = (
        (lambda c: c.get("delta", {}).get("content") or "")
        if path == CHAT
        else (lambda c: c.get("text") or "")
    )
    return "".join(key(c) for e in events if isinstance(e, dict) for c in e["choices"])


def relay(transcript: Transcript, blocks: list[bytes]) -> bytes:
    return b"".join(transcript.relayed(b) for b in blocks)


CHAT_BODY = {
    "model": MODEL,
    "stream": True,
    "max_tokens": 12,
    "messages": [{"role": "user", "content": "tell me about spot capacity"}],
}
COMPLETION_BODY = {"model": MODEL, "stream": True, "max_tokens": 12, "prompt": "Once upon a"}


@pytest.mark.parametrize("path, body", [(CHAT, CHAT_BODY), (COMPLETIONS, COMPLETION_BODY)])
@pytest.mark.parametrize("usage", [False, True])
def test_a_stream_cut_mid_answer_continues_as_one_stream(path, body, usage) -> None:
    """The gate cuts after 5 of 12 tokens; the continuation on another worker supplies the other
    7. The client's stream reads as one answer: one id, created and model, one role chunk, no
    error, one [DONE], the text of an uninterrupted generation, and usage (when asked) as one
    request's."""
    body = {**body, **({"stream_options": {"include_usage": True}} if usage else {})}
    whole = parse(b"".join(worker_stream(path, body, id_=ID)))
    transcript = Transcript.of(path, json.dumps(body).encode())
    assert transcript is not None

    first = relay(transcript, worker_stream(path, body, id_=ID, cut_after=5))
    assert b"interrupted" not in first  # held back, not relayed
    assert transcript.held_error == INTERRUPTED
    assert (transcript.tokens, transcript.continuable()) == (5, "")

    sent, carried = transcript.next_body()
    assert carried == Carried(chars=len(transcript.text), tokens=5)
    cont = json.loads(sent)
    assert cont["max_tokens"] == 7 and cont["stream_options"]["include_usage"] is True
    if path == CHAT:
        assert cont["messages"] == [
            *body["messages"],
            {"role": "assistant", "content": transcript.text},
        ]
        assert (cont["continue_final_message"], cont["add_generation_prompt"]) == (True, False)
    else:
        assert cont["prompt"] == body["prompt"] + transcript.text

    second = relay(transcript, worker_stream(path, cont, id_="chatcmpl-second"))
    events = parse(first + second)
    assert text_of(path, events) == text_of(path, whole)
    chunks = [e for e in events if isinstance(e, dict)]
    assert {(c["id"], c["created"], c["model"]) for c in chunks} == {(ID, CREATED, "served-" + ID)}
    if path == CHAT:
        assert sum("role" in c["delta"] for e in chunks for c in e["choices"]) == 1
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    usages = [e["usage"] for e in chunks if e.get("usage")]
    if usage:
        assert usages == [e["usage"] for e in whole if isinstance(e, dict) and e.get("usage")]
    else:
        assert usages == [] and all(c["choices"] for c in chunks)


def test_a_continuation_cut_in_turn_continues_again_and_counts_all_it_carried() -> None:
    """Cut at 3 tokens, the continuation cut after 4 more: the second continuation carries 7
    and asks for the last 5; the usage covers the three parts as one request."""
    body = {**CHAT_BODY, "stream_options": {"include_usage": True}}
    whole = parse(b"".join(worker_stream(CHAT, body, id_=ID)))
    transcript = Transcript.of(CHAT, json.dumps(body).encode())
    out = relay(transcript, worker_stream(CHAT, body, id_=ID, cut_after=3))
    cont, _ = transcript.next_body()
    out += relay(transcript, worker_stream(CHAT, json.loads(cont), id_="b", cut_after=4))
    assert transcript.held_error == INTERRUPTED
    cont, carried = transcript.next_body()
    assert carried.tokens == 7 and json.loads(cont)["max_tokens"] == 5
    # The carried text sits in the one assistant message, never two.
    assert [m["role"] for m in json.loads(cont)["messages"]] == ["user", "assistant"]
    out += relay(transcript, worker_stream(CHAT, json.loads(cont), id_="c"))
    events = parse(out)
    assert text_of(CHAT, events) == text_of(CHAT, whole)
    assert [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")] == [
        whole[-2]["usage"]
    ]


def test_the_first_part_goes_byte_for_byte_and_other_errors_pass() -> None:
    """What the first worker sends is relayed untouched, a worker's own (not interrupted) error
    event included: only the gate's interrupted event is the router's to decide on."""
    transcript = Transcript.of(CHAT, json.dumps(CHAT_BODY).encode())
    blocks = worker_stream(CHAT, CHAT_BODY, id_=ID, cut_after=2)[:-1]
    own_error = b'event: error\ndata: {"error": {"type": "server_error", "message": "x"}}\n\n'
    assert relay(transcript, [*blocks, own_error]) == b"".join(blocks) + own_error
    assert transcript.held_error == b""


def test_what_cannot_be_continued_gets_no_transcript() -> None:
    """Several choices, echo, logprobs, a list of prompts, a non-streamed or malformed body:
    no transcript, so a cut is reported interrupted as before."""

    def of(path: str, **changes: Any) -> Transcript | None:
        base = CHAT_BODY if path == CHAT else COMPLETION_BODY
        return Transcript.of(path, json.dumps({**base, **changes}).encode())

    assert of(CHAT) is not None and of(COMPLETIONS, prompt=["one"]) is not None
    assert of(CHAT, n=2) is None
    assert of(CHAT, logprobs=True) is None
    assert of(COMPLETIONS, echo=True) is None
    assert of(COMPLETIONS, prompt=["one", "two"]) is None
    assert of(COMPLETIONS, prompt=[1, 2, 3]) is None
    assert of(CHAT, stream=False) is None
    assert of(CHAT, max_tokens="12") is None
    assert Transcript.of(CHAT, b"{not json") is None
    assert Transcript.of("/v1/embeddings", json.dumps(CHAT_BODY).encode()) is None


def test_a_cut_after_the_last_token_or_before_the_first_is_not_continued() -> None:
    """Nothing left to generate (the finish went out, or every token was produced), or no
    chunk reached the client: the router reports interrupted, never asks for more."""
    transcript = Transcript.of(CHAT, json.dumps({**CHAT_BODY, "max_tokens": 3}).encode())
    relay(transcript, worker_stream(CHAT, {**CHAT_BODY, "max_tokens": 3}, id_=ID)[:-1])
    assert transcript.continuable() == "finished"
    blocks = worker_stream(CHAT, {**CHAT_BODY, "max_tokens": 4}, id_=ID)
    transcript = Transcript.of(CHAT, json.dumps({**CHAT_BODY, "max_tokens": 3}).encode())
    relay(transcript, blocks[:4])
    assert transcript.continuable() == "no_tokens_left"
    transcript = Transcript.of(CHAT, json.dumps(CHAT_BODY).encode())
    relay(transcript, [INTERRUPTED])
    assert transcript.continuable() == "no_chunk"


def test_the_client_continuing_its_own_message_has_the_text_appended_to_it() -> None:
    """A client already using continue_final_message: the carried text extends its assistant
    message, and the fake model continues it as one generation would."""
    body = {
        **CHAT_BODY,
        "messages": [*CHAT_BODY["messages"], {"role": "assistant", "content": "So:"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    transcript = Transcript.of(CHAT, json.dumps(body).encode())
    relay(transcript, worker_stream(CHAT, body, id_=ID, cut_after=2))
    cont = json.loads(transcript.next_body()[0])
    assert cont["messages"][-1] == {"role": "assistant", "content": "So:" + transcript.text}
    assert len(cont["messages"]) == 2
