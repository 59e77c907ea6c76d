"""The router's counters: served as JSON (/stats) and for Prometheus (/metrics)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    completed: int = 0  # a worker's answer relayed whole (a stream up to its [DONE])
    retried: int = 0  # attempts after a request's first (each sent to another worker)
    refused: int = 0  # requests the router answered itself with 503 (no worker, no table)
    interrupted: int = 0  # answers that ended interrupted, the gate's or the router's doing
    upstream_errors: int = 0  # connections to gates that failed or broke
    streams_continued: int = 0  # continuations that reached the client (one per seam)
    resent_after_cut: int = 0  # non-streamed answers cut before any byte, sent to another worker
    # Cut answers not continued, by why: no_worker, refused, cut_again, max_continuations,
    # finished, no_chunk, no_tokens_left, too_long, broke.
    continuation_failed: dict[str, int] = field(default_factory=dict)

    def failed(self, reason: str) -> None:
        self.continuation_failed[reason] = self.continuation_failed.get(reason, 0) + 1

    def prometheus_text(self) -> str:
        """The counters in Prometheus' text format, `spotdrain_router_` before each name."""
        lines = []
        for name, value in asdict(self).items():
            if isinstance(value, int):
                metric = f"spotdrain_router_{name}_total"
                lines += [f"# TYPE {metric} counter", f"{metric} {value}"]
        metric = "spotdrain_router_continuation_failed_total"
        lines.append(f"# TYPE {metric} counter")
        for reason, count in sorted(self.continuation_failed.items()):
            lines.append(f'{metric}{{reason="{reason}"}} {count}')
        return "\n".join(lines) + "\n"
