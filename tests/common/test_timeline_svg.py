"""The reclamation diagram (spotdrain.timeline.svg): what the dashboard and `spotctl timeline
--svg` draw. Pure: a Timeline in, SVG text out, read back here with an XML parser."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from spotdrain.timeline import svg
from spotdrain.v1 import spotdrain_pb2 as pb

NS = {"s": "http://www.w3.org/2000/svg"}
T0 = 1_800_000_000.0


def event(i: int, kind: str, t: float, uid: str = "", **details) -> pb.StoredEvent:
    return pb.StoredEvent(
        id=i,
        event=pb.Event(
            uid=uid or f"agent-{i}",
            kind=kind,
            node_id="node-a",
            reclaim_id="r-1",
            wall_time=T0 + t,
            t_offset_s=t,
            details_json=json.dumps(details),
        ),
    )


def timeline(events: list[pb.StoredEvent], **rec) -> pb.Timeline:
    fields = dict(
        reclaim_id="r-1",
        node_id="node-a",
        reason="notice",
        source="aws-imds",
        t0=T0,
        terminate_at=T0 + 10,
        grace_deadline=T0 + 8,
        overrun_at=T0 + 9.5,
    )
    fields.update(rec)
    return pb.Timeline(reclamation=pb.Reclamation(**fields), events=events)


def drained_story() -> pb.Timeline:
    events = [
        event(1, "notice_received", 0.0, notice_id="n-1"),
        event(2, "tainted", 0.012, mode="remote"),
        event(3, "replacement_unavailable", 0.02, uid="coordinator-x"),
        event(4, "sigterm_sent", 0.03, name="job"),
        event(5, "container_exited", 1.5, exit_code=0),
        event(6, "verified_empty", 1.7),
        event(7, "drained", 1.75, spare_s=8.25),
    ]
    return timeline(
        events,
        outcome="drained",
        spare_s=8.25,
        steps={"drained": T0 + 1.75, "verified_empty": T0 + 1.7},
    )


def parse(text: str) -> ET.Element:
    return ET.fromstring(text)


def expected_x(t: float, t_min: float, t_max: float) -> float:
    return svg.LEFT + (t - t_min) / (t_max - t_min) * svg.PLOT_W


def test_every_step_is_drawn_in_order_at_its_offset():
    """A drained notice: seven steps, numbered in the timeline's order, each mark at the x of
    its T+ on a scale from T0 to D (the latest mark), on its participant's lane."""
    root = parse(svg.render(drained_story()))
    steps = root.findall(".//s:g[@class='step']", NS)
    assert [s.get("data-kind") for s in steps] == [
        "notice_received",
        "tainted",
        "replacement_unavailable",
        "sigterm_sent",
        "container_exited",
        "verified_empty",
        "drained",
    ]
    assert [int(s.get("data-n")) for s in steps] == list(range(1, 8))
    for s in steps:
        t = float(s.get("data-t"))
        cx = float(s.find("s:circle", NS).get("cx"))
        assert cx == pytest.approx(expected_x(t, 0.0, 10.0), abs=0.01)
    assert [float(s.get("data-t")) for s in steps] == [0.0, 0.012, 0.02, 0.03, 1.5, 1.7, 1.75]
    # Lanes: the notice comes from the source to the agent, the coordinator's own step sits on
    # the coordinator's lane, an exit goes from the workloads to the agent.
    lane_y = {lane: svg.TOP + svg.LANE_H * (i + 0.5) for i, lane in enumerate(svg.LANES)}
    first, coord, exited = steps[0], steps[2], steps[4]
    assert float(first.find("s:circle", NS).get("cy")) == lane_y[svg.SOURCE]
    assert float(coord.find("s:circle", NS).get("cy")) == lane_y[svg.COORDINATOR]
    assert float(exited.find("s:circle", NS).get("cy")) == lane_y[svg.WORKLOADS]
    line = exited.find("s:line", NS)
    assert float(line.get("y1")) == lane_y[svg.WORKLOADS]
    assert float(line.get("y2")) < lane_y[svg.WORKLOADS]  # towards the agent, above
    # The hover text carries the step's details.
    assert "exit_code=0" in steps[4].find("s:title", NS).text


def test_g_o_and_d_are_lines_at_their_deadlines():
    root = parse(svg.render(drained_story()))
    lines = {g.get("data-name"): g for g in root.findall(".//s:g[@class='deadline']", NS)}
    assert sorted(lines) == ["D", "G", "O"]
    for name, t in (("G", 8.0), ("O", 9.5), ("D", 10.0)):
        line = lines[name].find("s:line", NS)
        assert float(line.get("x1")) == pytest.approx(expected_x(t, 0, 10), abs=0.01)
        assert line.get("x1") == line.get("x2")  # vertical
        assert float(lines[name].get("data-t")) == t


def test_drained_shades_the_spare_time_before_d():
    """Verified empty at T+1.75 with D at T+10: the 8.25 s between are shaded as spare."""
    root = parse(svg.render(drained_story()))
    shades = root.findall(".//s:g[@class]", NS)
    shades = [g for g in shades if g.get("class").startswith("shade")]
    assert [g.get("class") for g in shades] == ["shade spare"]
    rect = shades[0].find("s:rect", NS)
    assert float(rect.get("x")) == pytest.approx(expected_x(1.75, 0, 10), abs=0.01)
    assert float(rect.get("x")) + float(rect.get("width")) == pytest.approx(
        expected_x(10, 0, 10), abs=0.02
    )
    assert "spare 8.250 s" in shades[0].find("s:title", NS).text
    assert root.get("data-outcome") == "drained"
    assert "drained, verified empty with 8.250 s to spare" in svg.render(drained_story())


def test_overrun_shades_from_o_to_verified_empty():
    """A GPU process outlived the containers: overrun at O (T+9.5), the node seen empty only at
    T+12, past D. The red band runs from O to T+12; nothing is shaded as spare."""
    events = [
        event(1, "notice_received", 0.0),
        event(2, "tainted", 0.01, mode="local"),
        event(3, "overrun", 9.5, still_running=["gpu pid 7"]),
        event(4, "verified_empty", 12.0),
    ]
    tl = timeline(
        events, outcome="overrun", steps={"overrun": T0 + 9.5, "verified_empty": T0 + 12.0}
    )
    root = parse(svg.render(tl))
    shades = [g for g in root.findall(".//s:g[@class]", NS) if g.get("class").startswith("shade")]
    assert [g.get("class") for g in shades] == ["shade overrun"]
    assert (float(shades[0].get("data-from")), float(shades[0].get("data-to"))) == (9.5, 12.0)
    rect = shades[0].find("s:rect", NS)
    # The scale now runs to the last step, T+12.
    assert float(rect.get("x")) == pytest.approx(expected_x(9.5, 0, 12), abs=0.01)
    assert "OVERRUN" in svg.render(tl)


def test_in_progress_has_no_shading_and_says_so():
    tl = timeline([event(1, "notice_received", 0.0), event(2, "tainted", 0.01, mode="remote")])
    text = svg.render(tl)
    root = parse(text)
    assert not [g for g in root.findall(".//s:g[@class]", NS) if "shade" in g.get("class")]
    assert root.get("data-outcome") == "in progress"
    assert "outcome: in progress" in text


def test_a_hostile_detail_is_text_never_markup():
    """An agent (or a workload, through its status directory) puts markup, a script, quotes and
    control characters in a detail and in a container name. The document still parses, holds
    no element or attribute it did not write, and shows the text as text."""
    hostile = "</title><script>alert(1)</script><a href=\"javascript:x\" onload='y'>&amp;\x00\x1b"
    events = [
        event(1, "notice_received", 0.0, source=hostile),
        event(2, "checkpoint_committed", 0.5, generation=hostile, name=hostile),
    ]
    tl = timeline(events, reclaim_id='r-"><script>', node_id="<b>node</b>", source=hostile)
    text = svg.render(tl)
    root = parse(text)  # parses: nothing broke out
    tags = {el.tag.split("}")[1] for el in root.iter()}
    assert tags <= {"svg", "title", "text", "rect", "line", "g", "circle", "path"}
    assert "script" not in tags and "a" not in tags
    assert not [a for el in root.iter() for a in el.attrib if a.startswith("on")]
    assert "<script>" not in text
    titles = " ".join(el.text or "" for el in root.iter("{http://www.w3.org/2000/svg}title"))
    assert "<script>alert(1)</script>" in titles  # shown, as text
    assert root.get("data-reclaim-id") == 'r-"><script>'


def test_a_timeline_without_its_notice_yet_starts_at_its_first_event():
    """The coordinator's steps can be stored before the agent's notice_received arrives: T0 is
    not known yet, and the first event is the origin."""
    tl = timeline(
        [
            event(1, "replacement_unavailable", 0.0, uid="coordinator-1"),
            event(2, "tainted", 0.4, mode="remote"),
        ],
        t0=0.0,
        terminate_at=0.0,
        grace_deadline=0.0,
        overrun_at=0.0,
    )
    root = parse(svg.render(tl))
    steps = root.findall(".//s:g[@class='step']", NS)
    assert [float(s.get("data-t")) for s in steps] == [0.0, 0.4]
    assert not root.findall(".//s:g[@class='deadline']", NS)
