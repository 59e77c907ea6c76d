"""What spotctl prints for a person: tables and summaries, every field a tenant or a provider could
have written passed through printable() (a person's terminal is not the tenant's)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from spotdrain.protocol.cloud import cloud_label
from spotdrain.protocol.events import stored_event_to_dict
from spotdrain.protocol.managers import managers_label
from spotdrain.runtime.printable import printable
from spotdrain.v1 import spotdrain_pb2 as pb

REPUTATION_FORMULA = "score = (successes + 4) / (successes + failures + 5)"

_COMMON = {"id", "kind", "node", "reclaim_id", "wall_time", "t_offset_s", "uid"}


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    if isinstance(value, float):
        text = f"{value:.3f}"
    if len(text) > 24 and isinstance(value, str) and len(value) == 64:
        text = value[:12]  # container ids
    return text


def shown(lines: Iterable[str]) -> str:
    """Lines for a person: each escaped whole (spotdrain.runtime.printable), so no value in it, a
    tenant's file name or a node's reason, can move the cursor, ring, or start a line."""
    return "\n".join(printable(line) for line in lines)


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _offset(t: float, t0: float) -> str:
    return f"T{t - t0:+.3f}s"


def _when(t: float, now: float) -> str:
    """An absolute time and how far it is from now: `...Z (in 87.3 s)` or `...Z (2.0 s ago)`."""
    delta = t - now
    return f"{iso(t)} ({f'in {delta:.1f} s' if delta >= 0 else f'{-delta:.1f} s ago'})"


def _mode(spot: bool) -> str:
    return "spot" if spot else "on-demand"


def render_timeline(tl: pb.Timeline) -> str:
    rec = tl.reclamation
    t0 = rec.t0
    lines = [
        f"reclamation {rec.reclaim_id}  node {rec.node_id}  reason {rec.reason}  "
        f"notice {rec.notice_id} ({rec.source})",
        f"T0 {iso(t0)}   G {_offset(rec.grace_deadline, t0)}   "
        f"O {_offset(rec.overrun_at, t0)}   D {_offset(rec.terminate_at, t0)}",
        "",
        f"{'T+':>10}  {'step':<22} detail",
    ]
    if rec.reason == "lost":  # no notice, so no deadlines: T0 is when the node was last seen
        lines[:2] = [
            f"lost node {rec.node_id}  record {rec.reclaim_id}",
            f"T0 {iso(t0)} (last seen)",
        ]
    for stored in tl.events:
        d = stored_event_to_dict(stored)
        detail = {k: v for k, v in d.items() if k not in _COMMON}
        text = "  ".join(f"{k}={_short(v)}" for k, v in sorted(detail.items()))
        lines.append(f"{_offset(stored.event.wall_time, t0):>10}  {d['kind']:<22} {text}")
    lines.append("")
    if rec.outcome == "drained":
        lines.append(f"outcome: drained, verified empty with {rec.spare_s:.3f} s to spare before D")
    elif rec.outcome == "overrun":
        lines.append("outcome: OVERRUN: work was still there at O")
    elif rec.outcome == "lost":
        lines.append("outcome: LOST: the node vanished with its work, and no notice")
    elif rec.outcome:
        lines.append(f"outcome: {rec.outcome}")
    else:
        lines.append("outcome: in progress")
    return shown(lines)


def render_nodes(nodes: Iterable[pb.Node], now: float) -> str:
    header = (
        "node",
        "mode",
        "group",
        "provider",
        "workload",
        "workers",
        "rentals",
        "connected",
        "managers",
        "cloud",
    )
    rows, tails = [], []
    for n in nodes:
        rows.append(
            tuple(
                map(
                    printable,
                    (
                        n.node_id,
                        _mode(n.spot),
                        n.node_group or "-",
                        n.provider or "-",
                        "enabled" if n.workload_enabled else "disabled",
                        str(n.live_workers),
                        str(n.active_rentals),
                        "yes" if n.connected else "no",
                        managers_label(n.managers),
                        cloud_label(n),
                    ),
                )
            )  # escaped before the columns are measured
        )
        taints = ",".join(t.reason or t.key for t in n.taints) or "-"
        avoided = (
            f"  group avoided until {_when(n.group_avoided_until, now)}"
            if n.group_avoided_until
            else ""
        )
        tails.append(taints + avoided)
    # Columns as wide as their longest value (ids and group names vary by fleet).
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: tuple[str, ...], tail: str) -> str:
        return " ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " " + tail

    return shown([line(header, "taints"), *map(line, rows, tails)])


def _reclaim(r: pb.Rental, now: float) -> str:
    if not r.HasField("reclaim_at"):
        return ""
    cause = " ".join(x for x in (r.reclaim_reason, r.reclaim_id) if x)
    return f"RECLAIM at {_when(r.reclaim_at, now)}{f': {cause}' if cause else ''}"


def _ended(r: pb.Rental) -> str:
    if not r.HasField("ended_at"):
        return ""
    code = f", exit code {r.exit_code}" if r.HasField("exit_code") else ""
    return f"ended {iso(r.ended_at)} by {r.ended_by or '?'}{code}"


def render_rental(r: pb.Rental, now: float) -> str:
    lines = [
        f"rental {r.rental_id} on {r.node_id} (provider {r.provider or '-'}, "
        f"{_mode(r.started_on_spot)} at start): {r.state}",
        f"  renter {r.renter or '-'}  image {r.image}  gpus {r.gpus}  "
        f"started {iso(r.started_at) if r.started_at else '-'}",
    ]
    lines += [f"  {part}" for part in (_reclaim(r, now), _ended(r)) if part]
    if r.detail:
        lines.append(f"  detail: {r.detail}")
    return shown(lines)


def render_rentals(rentals: Iterable[pb.Rental], now: float) -> str:
    lines = [
        f"{'rental':<20} {'node':<14} {'state':<8} {'renter':<12} {'gpus':>4} {'at start':<9} "
        f"{'started':<24} reclaim / end"
    ]
    for r in rentals:
        started = iso(r.started_at) if r.started_at else "-"
        note = "; ".join(part for part in (_reclaim(r, now), _ended(r)) if part)
        lines.append(
            f"{r.rental_id:<20} {r.node_id:<14} {r.state:<8} {r.renter or '-':<12} {r.gpus:>4} "
            f"{_mode(r.started_on_spot):<9} {started:<24} {note or '-'}"
        )
    return shown(lines)


def render_reputation(rep: pb.Reputation) -> str:
    if rep.node_id:
        subject = f"node {rep.node_id}" + (f" (provider {rep.provider})" if rep.provider else "")
    else:
        subject = f"provider {rep.provider}"
    s, f = rep.successes, rep.failures
    return shown(
        [
            f"{subject}: score {rep.score:.3f}",
            f"  successes {s}  failures {f}  (counted {rep.counted})",
            f"  left out: excluded spot rentals {rep.excluded_spot}  "
            f"neutral reclaims {rep.neutral_reclaims}",
            f"  {REPUTATION_FORMULA} = ({s} + 4) / ({s} + {f} + 5)",
        ]
    )


def render_models(models: Iterable[pb.Model]) -> str:
    lines = [
        f"{'model':<20} {'replicas':>8} {'ready':>5} {'starting':>8} {'draining':>8} "
        f"{'slots':>5}  image"
    ]
    for m in models:
        lines.append(
            f"{m.model:<20} {m.replicas:>8} {m.ready:>5} {m.starting:>8} {m.draining:>8} "
            f"{m.slots:>5}  {m.image}"
        )
    return shown(lines)


def render_status(doc: dict[str, Any]) -> str:
    lines = [
        f"node {doc.get('node')}: {doc.get('state')}"
        f"{' (paused by its owner)' if doc.get('paused') else ''}"
    ]
    drain = doc.get("drain")
    if drain:
        lines.append(
            f"drain {drain['reclaim_id']} ({drain['reason']}): {drain['phase']}, "
            f"grace deadline in {drain['grace_in_s']:.1f} s, "
            f"deadline in {drain['deadline_in_s']:.1f} s"
        )
    for src in doc.get("sources", []):
        if src["up"]:
            seen = f", last read {iso(src['last_ok'])}" if src.get("last_ok") else ""
            lines.append(f"  notice source {src['source']}: up{seen}")
        else:
            lines.append(f"  notice source {src['source']}: DOWN ({src['error']})")
    for adv in doc.get("at_risk", []):
        lines.append(
            f"  at risk: {adv['reason']} from {adv['source']} until {iso(adv['expires_at'])}"
        )
    for w in doc.get("workers", []):
        lines.append(
            f"  worker {w['worker_id']}: {w['state']}, slots {w['slots_in_use']}/{w['capacity']}"
        )
    for r in doc.get("rentals", []):
        until = f", reclaim at {iso(r['reclaim_at'])}" if r.get("reclaim_at") else ""
        lines.append(f"  rental {r['rental_id']}: running{until}")
    for j in doc.get("jobs", []):
        lines.append(
            f"  {j['kind']} job {j['worker_id']}: {'draining' if j['draining'] else 'running'}"
        )
    return shown(lines)
