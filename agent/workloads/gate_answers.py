"""What the slot gate answers itself, rather than relaying the worker (agent/workloads/
slot_gate.py): a refusal, an unreachable worker, a request cut before its answer began.

How a cut reads for the client (invariant 7: an explicit error, never the normal end marker):

- An SSE stream gets one event and then a clean end of the HTTP response, never `data: [DONE]`:

      event: error
      data: {"error": {"type": "interrupted", "message": "...", "request_id": "..."}}

  The `event: error` line is for SSE clients in general. The `data:` line is what the official
  `openai` SDK acts on: its stream decoder (`openai/_streaming.py`, legacy mode, used for chat
  and completions) turns any event whose JSON data has a truthy "error" key into a raised
  `openai.APIError` (the base class, not `APIStatusError`, since the HTTP status was 200), with
  `body` = the "error" object. It does not look at the event name alone, and a stream that just
  ends without `[DONE]` ends the iteration normally, without an exception: so the data line is
  what makes a cut stream raise in the SDK. The gate relays whole SSE events only
  (spotdrain.http.relay holds a partial event until its blank line arrives), so when the
  worker dies mid-event the client's parser never sees half an event glued to ours; if the
  worker's own last event is already an error, the client has its explicit error and no
  second one is added.
- A streamed response that is not SSE (chunked) is aborted at the transport, without the
  terminating chunk, so the client sees a truncated body, never a clean end.
- A request cut before its response began gets 503 (cut by us) or 502 (the worker failed)
  with `{"error": {"type": "interrupted", ...}}`.
- A worker that cannot be reached at all (connection refused) is not an interruption: 502
  `upstream_unavailable`, or 503 `worker_draining` while draining.
"""

from __future__ import annotations

from aiohttp import hdrs, web

from spotdrain.http import sse


def error_response(
    status: int, kind: str, message: str, retry_after: str, request_id: str | None = None
) -> web.Response:
    """The gate's own error, as JSON, with Retry-After (and the request id, once it has one)."""
    return sse.error_response(status, kind, message, request_id, {hdrs.RETRY_AFTER: retry_after})


async def answer(request: web.BaseRequest, response: web.Response) -> web.StreamResponse:
    """Send the gate's own answer from inside a handler, its last bytes bounded
    (sse.FINAL_WRITE_TIMEOUT_S): a client that does not read is aborted."""
    if not await sse.bounded(send(request, response)):
        sse.abort(request)
    return response


async def send(request: web.BaseRequest, response: web.StreamResponse) -> None:
    await response.prepare(request)
    await response.write_eof()


def interrupted_message(reason: str) -> str:
    if reason == "stopped":
        return "the worker was stopped (node reclaimed or paused); the answer is incomplete"
    return "the worker failed mid-response; the answer is incomplete"
