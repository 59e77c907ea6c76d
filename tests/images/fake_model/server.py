"""A fake OpenAI-compatible model server, for tests and the demo. Python 3 stdlib only.

It runs as PID 1 in the `spotdrain-test/fake-model` image (see __init__.py beside it) and
generates tokens at a fixed pace, so that a test can hold a stream open for a known time.

Endpoints:
  POST /v1/chat/completions  OpenAI chat body (`model`, `messages`, `stream`, `max_tokens`).
                             Produces `max_tokens` tokens (default $TOKENS, 16) at $TOKENS_PER_S
                             (default 50; <= 0 means no pacing); the header X-Fake-Tokens-Per-S
                             overrides the pace for one request. Streamed: server-sent events in
                             OpenAI's chat.completion.chunk format, chunked, one write per token,
                             then `data: [DONE]`. Otherwise one chat.completion JSON with usage.
                             `continue_final_message` and `add_generation_prompt` as vLLM takes
                             them; the header X-Fake-Continuation: refuse answers 400 to a
                             continuation, as a server without them would.
  POST /v1/completions       The same with a `prompt` string; text_completion objects.

The text is a function of the prompt, as a greedy model's is: the messages are rendered into one
prompt (`role: content` lines, then `assistant: ` unless the last message is continued), and the
answer to a prompt P is the words of WORDS from an offset hashed from P. A prompt that ends with
the first k tokens of its head's answer (a continuation) gets that answer's tokens from k on, so
a continued text is exactly what the uninterrupted generation would have produced. Usage counts
prompt tokens as the head's words plus k.
  GET  /health               200 {"status":"ok"}
  GET  /v1/models            the model list: $MODEL (default "fake-model").

Every response carries X-Worker-Id: $WORKER_ID and echoes X-Request-Id when the request has one;
every request logs one line to stdout. Connections are not kept alive.

Signals, as a real server handles them: the first SIGTERM or SIGINT closes the listening socket
at once (new connections are refused), lets in-flight requests finish, then exits 0. A second
SIGTERM or SIGINT while draining exits at once (128 + signal number).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT = int(os.environ.get("PORT", "8000"))
WORKER_ID = os.environ.get("WORKER_ID", "")
MODEL = os.environ.get("MODEL", "fake-model")
DEFAULT_TOKENS = int(os.environ.get("TOKENS", "16"))
DEFAULT_TOKENS_PER_S = float(os.environ.get("TOKENS_PER_S", "50"))
STARTED = int(time.time())

WORDS = (
    "the quick brown fox jumps over a lazy dog while spot capacity drains "
    "and every open stream finishes before its worker stops"
).split()


_log_lock = threading.Lock()


def log(line: str) -> None:
    with _log_lock:
        sys.stdout.write(f"fake-model: {line}\n")
        sys.stdout.flush()


class BadRequest(Exception):
    pass


def _seed(head: str) -> int:
    return int.from_bytes(hashlib.sha256(head.encode()).digest()[:4], "big") % len(WORDS)


def _token(seed: int, i: int) -> str:
    return ("" if i == 0 else " ") + WORDS[(seed + i) % len(WORDS)]


def continuation_of(prompt: str) -> tuple[str, int, int]:
    """(head, seed, k): the prompt is head + the first k tokens of head's answer, with k the
    largest that fits (0: no continuation, the whole prompt is the head)."""
    best = (prompt, _seed(prompt), 0)
    for start in range(len(prompt) - 1, -1, -1):
        tail = prompt[start:]
        if not any(tail.startswith(word) for word in WORDS):
            continue
        seed = _seed(prompt[:start])
        if not tail.startswith(WORDS[seed]):
            continue
        text, k = "", 0
        while len(text) < len(tail):
            text += _token(seed, k)
            k += 1
        if text == tail:
            best = (prompt[:start], seed, k)
    return best


def render(messages: list, continue_final: bool, add_generation_prompt: bool) -> str:
    """The chat template: one line per message; the last left open when it is continued."""
    lines = [f"{m.get('role')}: {m.get('content') or ''}" for m in messages if isinstance(m, dict)]
    if continue_final:
        return "\n".join(lines)
    return "\n".join(lines) + "\n" + ("assistant: " if add_generation_prompt else "")


class Server(ThreadingHTTPServer):
    # In-flight requests are joined by server_close() when draining.
    daemon_threads = False
    block_on_close = True
    request_queue_size = 128

    def __init__(self, address):
        super().__init__(address, Handler)
        self.inflight = 0
        self.inflight_lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-model/1"
    sys_version = ""

    # --- plumbing: the worker header, the status for the log line, one log line per request

    def send_response(self, code, message=None):
        self._status = code
        super().send_response(code, message)

    def end_headers(self):
        self.send_header("X-Worker-Id", WORKER_ID)
        rid = self.headers.get("X-Request-Id") if self.headers else None
        if rid:
            self.send_header("X-Request-Id", rid)
        self.send_header("Connection", "close")
        self.close_connection = True
        super().end_headers()

    def log_message(self, format, *args):
        pass  # replaced by the one line per request in _run

    def _run(self, route):
        self._status = 0
        self._outcome = "ok"
        self._extra = ""
        started = time.monotonic()
        with self.server.inflight_lock:
            self.server.inflight += 1
        if self.command == "POST":
            # On arrival, with the routing-table version the router picked this worker under:
            # tests prove no request reaches a draining worker after the router saw the change.
            log(
                f"arrived {self.path} request_id={self.headers.get('X-Request-Id') or '-'} "
                f"route_version={self.headers.get('X-Route-Version') or '-'}"
            )
        try:
            route()
        except (BrokenPipeError, ConnectionResetError):
            self._outcome = "client_closed"
        except Exception as e:  # a bug here must still answer and log, never kill the server
            self._outcome = f"error:{type(e).__name__}"
            if not self._status:
                try:
                    self._json(500, {"error": {"message": str(e), "type": "server_error"}})
                except OSError:
                    pass
        finally:
            with self.server.inflight_lock:
                self.server.inflight -= 1
            rid = self.headers.get("X-Request-Id") or "-"
            log(
                f"{self.command} {self.path} request_id={rid} status={self._status} "
                f"duration_ms={(time.monotonic() - started) * 1000:.1f} "
                f"outcome={self._outcome}{self._extra} worker={WORKER_ID or '-'}"
            )

    def do_GET(self):
        self._run(self._get)

    def do_POST(self):
        self._run(self._post)

    # --- routes

    def _get(self):
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._json(200, {"status": "ok"})
        elif path == "/v1/models":
            self._json(
                200,
                {
                    "object": "list",
                    "data": [
                        {"id": MODEL, "object": "model", "created": STARTED, "owned_by": "fake"}
                    ],
                },
            )
        else:
            self._not_found()

    def _post(self):
        path = self.path.split("?", 1)[0]
        body = self._read_body()
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._not_found()
            return
        try:
            request = self._parse(path, body)
        except BadRequest as e:
            self._json(400, {"error": {"message": str(e), "type": "invalid_request_error"}})
            return
        if request["stream"]:
            self._stream(request)
        else:
            self._complete(request)

    # --- completions, chat and plain

    def _parse(self, path: str, body: bytes) -> dict:
        try:
            data = json.loads(body or b"null")
        except ValueError as e:
            raise BadRequest(f"body is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise BadRequest("body must be a JSON object")
        chat = path == "/v1/chat/completions"
        if chat:
            messages = data.get("messages")
            if not isinstance(messages, list):
                raise BadRequest("'messages' must be a list")
            continued = data.get("continue_final_message") is True
            generation_prompt = data.get("add_generation_prompt", True) is not False
            if continued and self.headers.get("X-Fake-Continuation") == "refuse":
                raise BadRequest("continue_final_message is not supported by this server")
            if continued and generation_prompt:
                # vLLM's own check: the two ask for opposite ends of the template.
                raise BadRequest(
                    "continue_final_message and add_generation_prompt exclude each other"
                )
            if continued and not (
                messages
                and isinstance(messages[-1], dict)
                and messages[-1].get("role") == "assistant"
            ):
                raise BadRequest("continue_final_message needs a last message from the assistant")
            prompt = render(messages, continued, generation_prompt)
        else:
            prompt = data.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise BadRequest("'prompt' must be a string")
        tokens = data.get("max_tokens")
        if tokens is None:
            tokens = data.get("max_completion_tokens", DEFAULT_TOKENS)
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            raise BadRequest(f"'max_tokens' must be a positive integer, not {tokens!r}")
        pace = self.headers.get("X-Fake-Tokens-Per-S")
        try:
            tokens_per_s = DEFAULT_TOKENS_PER_S if pace is None else float(pace)
        except ValueError:
            raise BadRequest(f"X-Fake-Tokens-Per-S must be a number, not {pace!r}") from None
        head, seed, first = continuation_of(prompt)
        if chat:
            # As before continuations: the words of the messages' contents, less the carried.
            prompt_tokens = sum(
                len(str(m.get("content") or "").split()) for m in messages if isinstance(m, dict)
            )
            prompt_tokens = prompt_tokens - len(prompt[len(head) :].split()) + first
        else:
            prompt_tokens = len(head.split()) + first
        options = data.get("stream_options") or {}
        self._extra = f" tokens={tokens} stream={int(bool(data.get('stream')))} from={first}"
        return {
            "chat": chat,
            "model": data.get("model") or MODEL,
            "stream": bool(data.get("stream")),
            "tokens": tokens,
            "tokens_per_s": tokens_per_s,
            "prompt_tokens": prompt_tokens,
            "seed": seed,
            "first": first,
            "include_usage": isinstance(options, dict) and bool(options.get("include_usage")),
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
            "created": int(time.time()),
        }

    @staticmethod
    def _tokens(request: dict):
        """Yield each token's text at its time: token i is due at start + (i + 1) / pace."""
        start = time.monotonic()
        pace = request["tokens_per_s"]
        for i in range(request["tokens"]):
            if pace > 0:
                delay = start + (i + 1) / pace - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            yield _token(request["seed"], request["first"] + i)

    @staticmethod
    def _usage(request: dict) -> dict:
        return {
            "prompt_tokens": request["prompt_tokens"],
            "completion_tokens": request["tokens"],
            "total_tokens": request["prompt_tokens"] + request["tokens"],
        }

    def _complete(self, request: dict) -> None:
        text = "".join(self._tokens(request))
        choice = {"index": 0, "logprobs": None, "finish_reason": "stop"}
        if request["chat"]:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        else:
            choice["text"] = text
        self._json(
            200,
            {
                "id": request["id"],
                "object": "chat.completion" if request["chat"] else "text_completion",
                "created": request["created"],
                "model": request["model"],
                "system_fingerprint": "fp_fake",
                "choices": [choice],
                "usage": self._usage(request),
            },
        )

    def _stream(self, request: dict) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        chat = request["chat"]

        def chunk(delta: dict, finish_reason=None, choices=True, usage=None) -> dict:
            choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
            if chat:
                choice["delta"] = delta
            else:
                choice["text"] = delta.get("content", "")
            out = {
                "id": request["id"],
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": request["created"],
                "model": request["model"],
                "system_fingerprint": "fp_fake",
                "choices": [choice] if choices else [],
            }
            if request["include_usage"]:
                out["usage"] = usage
            return out

        if chat:
            self._event(chunk({"role": "assistant", "content": "", "refusal": None}))
        for text in self._tokens(request):
            self._event(chunk({"content": text}))
        self._event(chunk({}, finish_reason="stop"))
        if request["include_usage"]:
            self._event(chunk({}, choices=False, usage=self._usage(request)))
        self._write_chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _event(self, payload: dict) -> None:
        self._write_chunk(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

    def _write_chunk(self, data: bytes) -> None:
        # wfile is unbuffered: one write, one flush to the socket.
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    # --- helpers

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _not_found(self) -> None:
        self._json(
            404,
            {"error": {"message": f"no route {self.command} {self.path}", "type": "not_found"}},
        )


def main() -> int:
    server = Server(("0.0.0.0", PORT))
    draining = threading.Event()

    def on_signal(signum, frame):
        if draining.is_set():
            log(f"{signal.Signals(signum).name} again while draining: exiting now")
            os._exit(128 + signum)
        draining.set()
        # shutdown() on a listening socket stops it listening: connects are refused from here
        # on, and serve_forever's select wakes up. The fd itself is closed by server_close().
        try:
            server.socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        log(f"{signal.Signals(signum).name}: not accepting; draining {server.inflight} request(s)")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    loop = threading.Thread(target=server.serve_forever, args=(0.05,), name="accept", daemon=True)
    loop.start()
    log(f"worker={WORKER_ID or '-'} model={MODEL} tokens={DEFAULT_TOKENS}")
    log(f"ready on :{PORT}")
    while not draining.wait(0.5):
        pass
    server.shutdown()  # the accept loop ends
    server.server_close()  # closes the socket and joins every in-flight request
    log("drained; exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
