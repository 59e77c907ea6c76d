"""One reclamation drawn as an SVG sequence diagram. Pure: a Timeline (the record and its events,
as `Admin.GetTimeline` answers) in, SVG text out.

The coordinator's dashboard and `spotctl timeline RECLAIM_ID --svg FILE` draw with this one
function, so both show the same picture. Time runs left to right in seconds from T0; a lane per
participant (notice source, agent, coordinator, workloads, acquirer); each step is a numbered
mark at its T+, an arrow where it passes between two participants, and a row of the table under
the chart; G, O and D are vertical lines; the spare time before D (drained) is shaded green, the
time work was still there after O (overrun) red.

Every string from the store is escaped: an event's details come from agents and workloads and
are untrusted (docs/design.md "Security").
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime

from spotdrain.v1 import spotdrain_pb2 as pb

SOURCE, AGENT, COORDINATOR, WORKLOADS, ACQUIRER = (
    "notice source",
    "agent",
    "coordinator",
    "workloads",
    "acquirer",
)
LANES = (SOURCE, AGENT, COORDINATOR, WORKLOADS, ACQUIRER)

# Where each kind of step happens: (from, to). from == to is a step inside one participant.
# Kinds not listed are the agent's, or the coordinator's when the coordinator recorded them.
_ARROWS: dict[str, tuple[str, str]] = {
    "notice_received": (SOURCE, AGENT),
    "notice_updated": (SOURCE, AGENT),
    "notice_invalid": (SOURCE, AGENT),
    "notice_cancelled": (SOURCE, AGENT),
    "notice_acknowledged": (AGENT, SOURCE),
    "notice_acknowledge_failed": (AGENT, SOURCE),
    "notice_source_down": (SOURCE, SOURCE),
    "notice_source_up": (SOURCE, SOURCE),
    "tainted": (AGENT, COORDINATOR),
    "deadline_file_written": (AGENT, WORKLOADS),
    "sigterm_sent": (AGENT, WORKLOADS),
    "sigkill_sent": (AGENT, WORKLOADS),
    "signal_failed": (AGENT, WORKLOADS),
    "worker_draining": (COORDINATOR, WORKLOADS),
    "stream_interrupted": (WORKLOADS, WORKLOADS),
    "stream_continued": (WORKLOADS, WORKLOADS),
    "container_exited": (WORKLOADS, AGENT),
    "checkpoint_started": (WORKLOADS, AGENT),
    "checkpoint_committed": (WORKLOADS, AGENT),
    "workload_report_invalid": (WORKLOADS, AGENT),
    "verification_failed": (AGENT, AGENT),
    "verified_empty": (AGENT, AGENT),
    "drained": (AGENT, COORDINATOR),
    "overrun": (AGENT, COORDINATOR),
    "replacement_requested": (COORDINATOR, ACQUIRER),
    "replacement_result": (ACQUIRER, COORDINATOR),
    "replacement_unavailable": (COORDINATOR, COORDINATOR),
}

# Geometry, in SVG user units. Tests place steps with these.
LEFT = 130.0  # the lane names' column
PLOT_W = 800.0
RIGHT = 40.0
TOP = 64.0  # the header
LANE_H = 44.0
ROW_H = 17.0  # one step's row in the table under the chart
MAX_DETAIL = 240  # characters of one step's detail text (the hover keeps up to MAX_TITLE)
MAX_TITLE = 2000

_COMMON = {"id", "kind", "node", "reclaim_id", "wall_time", "t_offset_s", "uid"}


@dataclass(frozen=True)
class Step:
    n: int  # 1-based, in the timeline's order
    kind: str
    t: float  # seconds from T0
    source: str  # lane it comes from
    target: str  # lane it goes to
    detail: str  # k=v pairs, untrusted text


@dataclass(frozen=True)
class Scale:
    """Seconds from T0 to x. The domain covers T0, D and every step."""

    t_min: float
    t_max: float

    def x(self, t: float) -> float:
        span = self.t_max - self.t_min
        return LEFT + (t - self.t_min) / span * PLOT_W if span > 0 else LEFT


def origin(tl: pb.Timeline) -> float:
    """T0, or the first event's time for a reclamation whose notice is not stored yet."""
    if tl.reclamation.t0:
        return tl.reclamation.t0
    return min((e.event.wall_time for e in tl.events), default=0.0)


def steps_of(tl: pb.Timeline) -> list[Step]:
    t0 = origin(tl)
    out = []
    for i, stored in enumerate(tl.events, start=1):
        ev = stored.event
        source, target = _ARROWS.get(ev.kind, (None, None))
        if source is None:
            lane = COORDINATOR if ev.uid.startswith("coordinator-") else AGENT
            source = target = lane
        out.append(Step(i, ev.kind, ev.wall_time - t0, source, target, _detail(ev)))
    return out


def scale_of(tl: pb.Timeline) -> Scale:
    rec, t0 = tl.reclamation, origin(tl)
    marks = [0.0] + [s.t for s in steps_of(tl)]
    marks += [m - t0 for m in (rec.grace_deadline, rec.overrun_at, rec.terminate_at) if m]
    return Scale(min(marks), max(marks))


def render(tl: pb.Timeline) -> str:
    """The whole SVG document."""
    rec = tl.reclamation
    t0 = origin(tl)
    steps = steps_of(tl)
    scale = scale_of(tl)
    lanes_bottom = TOP + LANE_H * len(LANES)
    table_top = lanes_bottom + 40
    width = LEFT + PLOT_W + RIGHT
    height = table_top + ROW_H * (len(steps) + 1) + 16
    lane_y = {lane: TOP + LANE_H * (i + 0.5) for i, lane in enumerate(LANES)}
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" width="{width:.0f}" '
        f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
        f'font-family="sans-serif" font-size="12" data-reclaim-id="{_a(rec.reclaim_id)}" '
        f'data-outcome="{_a(rec.outcome or "in progress")}">',
        f"<title>{_t(f'reclamation {rec.reclaim_id} on {rec.node_id}')}</title>",
        f'<text x="8" y="20" font-size="15" font-weight="bold">{_t(_headline(rec))}</text>',
        f'<text x="8" y="40" class="outcome">{_t(outcome_text(rec))}</text>',
    ]
    for i, lane in enumerate(LANES):
        y = lane_y[lane]
        fill = "#f4f4f4" if i % 2 == 0 else "#ffffff"
        out.append(
            f'<rect x="0" y="{TOP + LANE_H * i:.1f}" width="{width:.0f}" '
            f'height="{LANE_H:.1f}" fill="{fill}"/>'
        )
        out.append(f'<text x="8" y="{y + 4:.1f}" class="lane">{_t(lane)}</text>')
        out.append(
            f'<line x1="{LEFT:.1f}" y1="{y:.1f}" x2="{LEFT + PLOT_W:.1f}" y2="{y:.1f}" '
            f'stroke="#bbb" stroke-dasharray="2 3"/>'
        )
    out += _shading(rec, t0, tl, scale, lanes_bottom)
    out += _axis(scale, lanes_bottom)
    for name, at, colour in (
        ("G", rec.grace_deadline, "#c77800"),
        ("O", rec.overrun_at, "#b00020"),
        ("D", rec.terminate_at, "#000000"),
    ):
        if not at:
            continue
        x = scale.x(at - t0)
        out.append(
            f'<g class="deadline" data-name="{name}" data-t="{at - t0:.3f}">'
            f"<title>{_t(f'{name} at T+{at - t0:.3f} s ({_iso(at)})')}</title>"
            f'<line x1="{x:.2f}" y1="{TOP - 6:.1f}" x2="{x:.2f}" y2="{lanes_bottom:.1f}" '
            f'stroke="{colour}" stroke-width="1.5" stroke-dasharray="6 3"/>'
            f'<text x="{x:.2f}" y="{TOP - 9:.1f}" text-anchor="middle" fill="{colour}" '
            f'font-weight="bold">{name}</text></g>'
        )
    for s in steps:
        out.append(_step(s, scale, lane_y))
    out += _table(steps, table_top)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def outcome_text(rec: pb.Reclamation) -> str:
    if rec.outcome == "drained":
        spare = f" with {rec.spare_s:.3f} s to spare before D" if rec.HasField("spare_s") else ""
        return f"outcome: drained, verified empty{spare}"
    if rec.outcome == "overrun":
        return "outcome: OVERRUN: work was still there at O"
    if rec.outcome:
        return f"outcome: {rec.outcome}"
    return "outcome: in progress"


def _headline(rec: pb.Reclamation) -> str:
    reason = rec.reason or "?"
    source = f" from {rec.source}" if rec.source else ""
    t0 = f", T0 {_iso(rec.t0)}" if rec.t0 else ""
    return f"reclamation {rec.reclaim_id} on {rec.node_id}: {reason}{source}{t0}"


def _shading(
    rec: pb.Reclamation, t0: float, tl: pb.Timeline, scale: Scale, bottom: float
) -> list[str]:
    """Spare (verified empty, then D) green; overrun (O, then verified empty or the last step)
    red."""
    if rec.outcome == "drained" and rec.terminate_at:
        drained = rec.steps.get("drained") or rec.steps.get("verified_empty")
        if drained is None and rec.HasField("spare_s"):
            drained = rec.terminate_at - rec.spare_s
        if drained is None:
            return []
        a, b, cls, colour = drained - t0, rec.terminate_at - t0, "spare", "#2e7d32"
        label = f"spare {rec.spare_s:.3f} s" if rec.HasField("spare_s") else "spare"
    elif rec.outcome == "overrun" and rec.overrun_at:
        empty = rec.steps.get("verified_empty")
        last = max((e.event.wall_time for e in tl.events), default=rec.overrun_at)
        end = empty if empty is not None and empty > rec.overrun_at else max(last, rec.overrun_at)
        a, b, cls, colour = rec.overrun_at - t0, end - t0, "overrun", "#b00020"
        label = f"overrun {b - a:.3f} s" + ("" if empty else ", not verified empty")
    else:
        return []
    x1, x2 = scale.x(min(a, b)), scale.x(max(a, b))
    return [
        f'<g class="shade {cls}" data-from="{min(a, b):.3f}" data-to="{max(a, b):.3f}">'
        f"<title>{_t(label)}</title>"
        f'<rect x="{x1:.2f}" y="{TOP:.1f}" width="{max(x2 - x1, 1.0):.2f}" '
        f'height="{bottom - TOP:.1f}" fill="{colour}" fill-opacity="0.18"/>'
        f'<text x="{(x1 + x2) / 2:.2f}" y="{bottom + 30:.1f}" text-anchor="middle" '
        f'fill="{colour}">{_t(label)}</text></g>'
    ]


def _axis(scale: Scale, bottom: float) -> list[str]:
    out = [
        f'<line x1="{LEFT:.1f}" y1="{bottom:.1f}" x2="{LEFT + PLOT_W:.1f}" y2="{bottom:.1f}" '
        'stroke="#333"/>'
    ]
    span = scale.t_max - scale.t_min
    if span <= 0:
        return out
    step = _tick(span)
    t = math.ceil(scale.t_min / step) * step
    while t <= scale.t_max + 1e-9:
        x = scale.x(t)
        out.append(
            f'<line x1="{x:.2f}" y1="{bottom:.1f}" x2="{x:.2f}" y2="{bottom + 4:.1f}" '
            'stroke="#333"/>'
        )
        out.append(
            f'<text x="{x:.2f}" y="{bottom + 16:.1f}" text-anchor="middle" '
            f'font-size="10">T+{t:g}</text>'
        )
        t += step
    return out


def _tick(span: float) -> float:
    raw = span / 10
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)


def _step(s: Step, scale: Scale, lane_y: dict[str, float]) -> str:
    x = scale.x(s.t)
    y1, y2 = lane_y[s.source], lane_y[s.target]
    title = _t(f"{s.n}. T+{s.t:.3f} s {s.kind}" + (f"\n{s.detail}" if s.detail else ""), MAX_TITLE)
    parts = [
        f'<g class="step" data-n="{s.n}" data-kind="{_a(s.kind)}" data-t="{s.t:.3f}" '
        f'data-x="{x:.2f}"><title>{title}</title>'
    ]
    if y1 != y2:
        head = -5 if y2 > y1 else 5
        parts.append(
            f'<line x1="{x:.2f}" y1="{y1:.1f}" x2="{x:.2f}" y2="{y2 + head:.1f}" '
            'stroke="#1f4e99" stroke-width="1.2"/>'
        )
        parts.append(
            f'<path d="M{x - 3.5:.2f},{y2 + head:.1f} L{x + 3.5:.2f},{y2 + head:.1f} '
            f'L{x:.2f},{y2:.1f} Z" fill="#1f4e99"/>'
        )
    parts.append(f'<circle cx="{x:.2f}" cy="{y1:.1f}" r="4.5" fill="#1f4e99"/>')
    parts.append(f'<text x="{x + 5:.2f}" y="{y1 - 7:.1f}" font-size="10">{s.n}</text></g>')
    return "".join(parts)


def _table(steps: list[Step], top: float) -> list[str]:
    out = [
        f'<text x="8" y="{top:.1f}" font-weight="bold">#</text>'
        f'<text x="40" y="{top:.1f}" font-weight="bold">T+ (s)</text>'
        f'<text x="110" y="{top:.1f}" font-weight="bold">step</text>'
        f'<text x="300" y="{top:.1f}" font-weight="bold">detail</text>'
    ]
    for i, s in enumerate(steps, start=1):
        y = top + ROW_H * i
        out.append(
            f'<g class="row" data-n="{s.n}"><title>{_t(s.detail, MAX_TITLE)}</title>'
            f'<text x="8" y="{y:.1f}">{s.n}</text>'
            f'<text x="40" y="{y:.1f}">{s.t:.3f}</text>'
            f'<text x="110" y="{y:.1f}">{_t(s.kind)}</text>'
            f'<text x="300" y="{y:.1f}" font-size="11">{_t(s.detail, 90)}</text></g>'
        )
    return out


def _detail(ev: pb.Event) -> str:
    try:
        details = json.loads(ev.details_json) if ev.details_json else {}
    except ValueError:
        return "(details not JSON)"
    if not isinstance(details, dict):
        return ""
    parts = []
    for key in sorted(details):
        if key in _COMMON:
            continue
        value = details[key]
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        if isinstance(value, float):
            text = f"{value:.3f}"
        parts.append(f"{key}={text[:MAX_DETAIL]}")
    return "  ".join(parts)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


# Characters XML 1.0 cannot carry at all (escaping does not help): replaced, so a hostile detail
# cannot make the document unparseable.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _t(text: str, limit: int = MAX_DETAIL) -> str:
    """Text content: escaped, shortened, XML-safe."""
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    text = _NOT_XML.sub("\ufffd", text)
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _a(text: str) -> str:
    """An attribute value (always written in double quotes)."""
    return _t(text).replace('"', "&quot;").replace("'", "&#39;")
