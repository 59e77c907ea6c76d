"""The coordinator's dashboard in a real browser (Debian's chromium, headless, driven by
Playwright) over real parts: a coordinator with mutual TLS and the dashboard on loopback, an
agent over fake GPUs, a real Docker engine running a renter's container and two batch jobs."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from fakes.dockerenv import run_workload
from fakes.harness import BIN, AgentOptions, start_agent, start_coordinator
from fakes.waiting import wait_until
from spotdrain.timeline import svg as timeline_svg
from spotdrain.v1 import spotdrain_pb2 as pb
from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

pytestmark = pytest.mark.docker

TOKEN = "dashboard-test-token-0123456789abcdef"


def steps_on_page(page) -> list[dict]:
    return page.eval_on_selector_all(
        "#diagram g.step",
        "gs => gs.map(g => ({kind: g.dataset.kind, t: Number(g.dataset.t),"
        " cx: Number(g.querySelector('circle').getAttribute('cx'))}))",
    )


def test_an_operator_watches_a_notice_drain_a_rented_node(
    tmp_path, docker_engine, pki, gpus, nvml_lib, containers, rental_image, browser
):
    """An operator opens the dashboard. Without the token the fleet shows, read-only, and a
    pause is refused; with it, switching the rented spot node to on-demand is refused with the
    API's reason. A provider's notice then gives the node ten seconds: the reclamation's page,
    opened while it runs, gains its steps as they happen, without a reload, and ends drained,
    every step of the stored timeline drawn in order at its T+, G, O and D where they belong,
    the spare time shaded. spotctl draws the same picture."""
    shots = tmp_path / "screenshots"
    shots.mkdir()
    print(f"dashboard screenshots in {shots}")
    token_file = tmp_path / "dashboard.token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    coordinator = start_coordinator(
        tmp_path / "coordinator",
        tls=pki,
        extra=("--dashboard-listen", "127.0.0.1:0", "--dashboard-token-file", str(token_file)),
    )
    url = re.search(r"dashboard on (http://\S+)/", coordinator.proc.log()).group(1)
    client = docker_engine.client
    run_workload(
        client,
        name=containers + "ckpt",
        node_id="node-a",
        kind="checkpoints",
        env={"CHECKPOINT_S": "2"},
    )
    run_workload(client, name=containers + "stubborn", node_id="node-a", kind="ignores_term")
    agent = start_agent(
        tmp_path,
        "node-a",
        coordinator,
        docker_engine.host,
        gpus,
        nvml_lib,
        AgentOptions(grace_s=4.0, overrun_s=1.0, extra=["--spot", "true"]),
    )
    admin = coordinator.admin()
    renter = pb_grpc.RentalsStub(coordinator.channel(pki.issue("renter:alice")))
    rental_id = ""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        wait_until(lambda: any(n.connected for n in admin.nodes()), 20, "node-a to register")
        rental_id = renter.CreateRental(
            pb.CreateRentalRequest(node_id="node-a", image=rental_image)
        ).rental_id
        wait_until(
            lambda: renter.GetRental(pb.GetRentalRequest(rental_id=rental_id)).state == "running",
            30,
            "the rental to run",
        )

        # Read-only without a credential: the fleet shows; an action is refused, nothing moves.
        page.goto(f"{url}/")
        row = page.locator('tr[data-node="node-a"]')
        assert row.locator("td.spot").inner_text() == "spot"
        assert rental_id in row.inner_text()
        row.get_by_role("button", name="pause").click()
        page.wait_for_selector("#message.refused")
        assert "refused (401)" in page.inner_text("#message")
        assert [n.workload_enabled for n in admin.nodes()] == [True]
        answers = page.evaluate(
            """async () => Promise.all([{}, {"X-Spotdrain-Token": "wrong-token-0123456789"}]
                .map(h => fetch("/api/nodes/node-a/spot", {method: "POST", body: "{}",
                    headers: Object.assign({"Content-Type": "application/json"}, h)})
                .then(r => r.status)))"""
        )
        assert answers == [401, 403]
        assert page.request.get(f"{url}/api/nodes/node-a/pause").status == 405  # never a GET

        # With the token: the spot flag of a rented node cannot change, and the page says why.
        page.fill("#token", TOKEN)
        page.click("#token-form button")
        row.get_by_role("button", name="make on-demand").click()
        page.wait_for_selector("#message.refused")
        message = page.inner_text("#message")
        assert "refused (409)" in message and rental_id in message and "active rental" in message
        assert [n.spot for n in admin.nodes()] == [True]
        page.screenshot(path=str(shots / "fleet-spot-refused.png"), full_page=True)

        # The notice; the reclamation's page opened while it runs.
        agent.write_notice(
            {
                "id": "i-dash-1",
                "action": "terminate",
                "terminate_at": time.time() + 10,
                "source": "aws-imds",
            }
        )
        reclaim_id = admin.wait_for("notice_received", node="node-a", timeout=10)["reclaim_id"]
        page.goto(f"{url}/reclamations/{reclaim_id}")
        page.wait_for_selector("#diagram svg")
        page.evaluate("window.sameDocument = true")
        first = len(steps_on_page(page))
        assert page.inner_text("#outcome") == "outcome: in progress"
        # Polled from here: the page's CSP forbids the eval wait_for_function would need.
        wait_until(lambda: len(steps_on_page(page)) > first, 15, "a new step without a reload")
        page.screenshot(path=str(shots / "reclamation-in-progress.png"), full_page=True)
        wait_until(lambda: "drained" in page.inner_text("#outcome"), 30, "drained, live")
        assert page.evaluate("window.sameDocument") is True  # no reload
        tl = admin.timeline(reclaim_id)
        rec = tl.reclamation
        # Steps that came after drained (a rental's end) arrive in one more update.
        wait_until(
            lambda: len(steps_on_page(page)) == len(admin.timeline(reclaim_id).events),
            10,
            "the last steps on the page",
        )
        tl = admin.timeline(reclaim_id)
        drawn = steps_on_page(page)
        kinds = [e.event.kind for e in tl.events]
        assert [s["kind"] for s in drawn] == kinds
        assert kinds[0] == "notice_received" and "drained" in kinds
        assert kinds.index("tainted") < kinds.index("sigterm_sent") < kinds.index("sigkill_sent")
        assert len(drawn) > first
        scale = timeline_svg.scale_of(tl)
        for step, stored in zip(drawn, tl.events, strict=True):
            t = stored.event.wall_time - rec.t0
            assert step["t"] == pytest.approx(t, abs=0.001)
            assert step["cx"] == pytest.approx(scale.x(t), abs=0.01)
        assert [s["t"] for s in drawn] == sorted(s["t"] for s in drawn)
        lines = {
            name: page.locator(f'#diagram g.deadline[data-name="{name}"] line')
            for name in ("G", "O", "D")
        }
        for name, at in (("G", rec.grace_deadline), ("O", rec.overrun_at), ("D", rec.terminate_at)):
            x = float(lines[name].get_attribute("x1"))
            assert x == pytest.approx(scale.x(at - rec.t0), abs=0.01), name
        # As the browser lays them out: G, then O, then D, left to right, and the notice at T0
        # left of them all.
        box = {name: line.bounding_box()["x"] for name, line in lines.items()}
        notice = page.locator("#diagram g.step[data-n='1'] circle").bounding_box()["x"]
        assert notice < box["G"] < box["O"] < box["D"]
        assert rec.outcome == "drained" and 0 < rec.spare_s < 6
        outcome = page.inner_text("#outcome")
        assert (
            outcome == f"outcome: drained, verified empty with {rec.spare_s:.3f} s to spare "
            "before D"
        )
        spare = page.locator("#diagram g.shade.spare")
        assert spare.count() == 1
        drained_at = rec.steps["drained"] - rec.t0
        assert float(spare.get_attribute("data-from")) == pytest.approx(drained_at, abs=0.001)
        assert float(spare.get_attribute("data-to")) == pytest.approx(
            rec.terminate_at - rec.t0, abs=0.001
        )
        page.screenshot(path=str(shots / "reclamation-drained.png"), full_page=True)

        # The list: newest first, with its outcome.
        page.goto(f"{url}/reclamations")
        listed = page.locator(f'tr[data-reclaim-id="{reclaim_id}"] td.outcome').inner_text()
        assert listed == f"drained, {rec.spare_s:.3f} s spare"

        # spotctl draws what the dashboard draws.
        svg_file = tmp_path / "timeline.svg"
        argv = [
            str(BIN / "spotctl"),
            *coordinator.cli_args(),
            "timeline",
            reclaim_id,
            "--svg",
            str(svg_file),
        ]
        subprocess.run(argv, check=True, capture_output=True, timeout=30)
        served = page.request.get(f"{url}/reclamations/{reclaim_id}/svg").text()
        assert svg_file.read_text() == served == timeline_svg.render(admin.timeline(reclaim_id))
    finally:
        page.close()
        agent.proc.stop()
        coordinator.proc.stop()
        if rental_id:
            for c in client.containers.list(all=True, filters={"name": rental_id}):
                c.remove(force=True)
