"""The dashboard's HTML: pure functions of what the API answers, every string escaped (node ids,
groups, images, details: much of it comes from agents and is untrusted)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from html import escape
from typing import Any
from urllib.parse import quote

from spotdrain.protocol.cloud import cloud_label
from spotdrain.protocol.managers import managers_label
from spotdrain.v1 import spotdrain_pb2 as pb


def e(value: Any) -> str:
    return escape(str(value), quote=True)


def iso(t: float | None) -> str:
    if not t:
        return ""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S") + "Z"


def layout(title: str, body: str, actions_on: bool) -> str:
    token = (
        '<form id="token-form"><label>operator token '
        '<input id="token" type="password" autocomplete="off"></label> '
        '<button type="submit">use for actions</button></form>'
        if actions_on
        else '<p class="note">read-only: the coordinator has no --dashboard-token-file</p>'
    )
    return (
        '<!doctype html><html><head><meta charset="utf-8">'
        f"<title>{e(title)} · spotdrain</title>"
        '<link rel="stylesheet" href="/static/dashboard.css"></head><body>'
        '<nav><a href="/">fleet</a> <a href="/reclamations">reclamations</a></nav>'
        f'{token}<div id="message" role="status"></div>'
        f"<h1>{e(title)}</h1>{body}"
        '<script src="/static/dashboard.js"></script></body></html>'
    )


def _button(label: str, url: str, body: dict[str, Any] | None = None) -> str:
    data = f' data-body="{e(json.dumps(body))}"' if body is not None else ""
    return f'<button data-action="{e(url)}"{data}>{e(label)}</button>'


def fleet(
    nodes: Sequence[pb.Node],
    workers: dict[str, list[pb.WorkerInfo]],
    rentals: dict[str, list[Any]],
    risks: dict[str, dict[str, float]],
    avoided: dict[str, float],
    models: Sequence[pb.Model],
    next_after: str | None,
    now: float,
) -> str:
    rows = []
    for n in nodes:
        node_url = quote(n.node_id, safe="")
        taints = "<br>".join(f"{e(t.reason)} {e(t.reclaim_id)}" for t in n.taints) or "none"
        node_risks = risks.get(n.node_id, {})
        at_risk = (
            "<br>".join(
                f"{e(k)} until {e(iso(u))}" for k, u in sorted(node_risks.items()) if u > now
            )
            or ""
        )
        ws = "<br>".join(
            f"{e(w.worker_id)} {e(w.model)} {e(w.state)} slots {w.slots_in_use}/{w.capacity}"
            for w in workers.get(n.node_id, [])
        )
        rs = "<br>".join(
            f"{e(r.rental_id)} {e(r.renter)}"
            + (f" reclaim at {e(iso(r.reclaim_at))}" if r.reclaim_at else "")
            for r in rentals.get(n.node_id, [])
        )
        group = e(n.node_group)
        until = avoided.get(n.node_group)
        if until:
            group += f'<br><span class="warn">avoided until {e(iso(until))}</span>'
        paused = any(t.reason == "pause" for t in n.taints) or not n.workload_enabled
        actions = " ".join(
            [
                _button(
                    "resume" if paused else "pause",
                    f"/api/nodes/{node_url}/{'resume' if paused else 'pause'}",
                ),
                _button(
                    "make on-demand" if n.spot else "make spot",
                    f"/api/nodes/{node_url}/spot",
                    {"spot": not n.spot},
                ),
            ]
        )
        rows.append(
            f'<tr data-node="{e(n.node_id)}"><td>{e(n.node_id)}</td>'
            f'<td class="spot">{"spot" if n.spot else "on-demand"}</td><td>{group}</td>'
            f"<td>{'on' if n.workload_enabled else 'off'}</td><td>{taints}</td>"
            f"<td>{at_risk}</td><td>{ws}</td><td>{rs}</td>"
            f"<td>{'connected' if n.connected else 'gone since ' + e(iso(n.last_seen))}</td>"
            f'<td class="managers">{e(managers_label(n.managers))}</td>'
            f'<td class="cloud" title="{e(n.cloud.instance_id)}">{e(cloud_label(n))}</td>'
            f"<td>{actions}</td></tr>"
        )
    more = (
        f'<p><a href="/?after={quote(next_after, safe="")}">next page</a></p>' if next_after else ""
    )
    model_rows = "".join(
        f"<tr><td>{e(m.model)}</td><td>{m.replicas}</td><td>{m.ready}</td><td>{m.starting}</td>"
        f"<td>{m.draining}</td><td>{e(m.image)}</td><td>{m.slots}</td></tr>"
        for m in models
    )
    return (
        '<table id="nodes"><thead><tr><th>node</th><th>mode</th><th>group</th>'
        "<th>workload</th><th>taints</th><th>at risk</th><th>workers (slots)</th>"
        "<th>rentals</th><th>connection</th><th>managers</th><th>cloud</th><th>actions</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>{more}"
        '<h2>models</h2><table id="models"><thead><tr><th>model</th><th>desired</th>'
        "<th>ready</th><th>starting</th><th>draining</th><th>image</th><th>slots</th></tr>"
        f"</thead><tbody>{model_rows}</tbody></table>"
        '<form id="replicas-form"><label>model <input name="model" required></label> '
        '<label>replicas <input name="replicas" type="number" min="0" required></label> '
        '<label>image <input name="image"></label> '
        '<label>slots <input name="slots" type="number" min="0"></label> '
        '<button type="submit">set replicas</button></form>'
    )


def outcome_cell(rec: dict[str, Any]) -> str:
    outcome = rec.get("outcome") or ""
    if outcome == "drained":
        spare = rec.get("spare_s")
        return f"drained, {spare:.3f} s spare" if isinstance(spare, int | float) else "drained"
    if outcome == "overrun":
        empty = rec.get("steps", {}).get("verified_empty")
        at = rec.get("overrun_at") or 0.0
        if isinstance(empty, int | float) and at and empty > at:
            return f"OVERRUN, empty {empty - at:.3f} s after O"
        return "OVERRUN, not verified empty"
    if outcome == "lost":
        return "LOST, no notice"
    return outcome or "in progress"


def reclamations(records: Sequence[dict[str, Any]], next_before: str | None) -> str:
    rows = "".join(
        f'<tr data-reclaim-id="{e(r["reclaim_id"])}">'
        f'<td><a href="/reclamations/{quote(r["reclaim_id"], safe="")}">'
        f"{e(r['reclaim_id'])}</a></td><td>{e(r['node_id'])}</td><td>{e(r.get('reason', ''))}"
        f'</td><td>{e(iso(r.get("t0")))}</td><td class="outcome">{e(outcome_cell(r))}</td></tr>'
        for r in records
    )
    more = (
        f'<p><a href="/reclamations?before={quote(next_before, safe="")}">older</a></p>'
        if next_before
        else ""
    )
    return (
        '<table id="reclamations"><thead><tr><th>reclamation</th><th>node</th><th>reason</th>'
        f"<th>T0</th><th>outcome</th></tr></thead><tbody>{rows}</tbody></table>{more}"
    )


def reclamation(tl: pb.Timeline, drawing: str, outcome: str) -> str:
    rid = tl.reclamation.reclaim_id
    live = (
        ""
        if tl.reclamation.outcome
        else (f' data-live="/reclamations/{e(quote(rid, safe=""))}/live"')
    )
    return (
        f'<p id="outcome">{e(outcome)}</p>'
        f'<p><a href="/reclamations/{e(quote(rid, safe=""))}/svg">the SVG alone</a></p>'
        # The drawing is the renderer's own output: every string in it is escaped there.
        f'<div id="diagram"{live}>{drawing}</div>'
    )
