"""Prometheus metrics on both daemons, checked by `promtool check metrics` on live scrapes
after a real reclamation, so the histograms hold data."""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request

import pytest

from fakes.dockerenv import run_workload
from fakes.harness import AgentOptions, start_agent, start_coordinator
from fakes.waiting import wait_until

pytestmark = pytest.mark.docker


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def promtool_check(text: str) -> None:
    run = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert run.returncode == 0, run.stdout + run.stderr


def sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = re.match(r"([a-z_]+)(\{[^}]*\})? (\S+)", line)
        if (
            match
            and match.group(1) == name
            and all(f'{k}="{v}"' in (match.group(2) or "") for k, v in labels.items())
        ):
            return float(match.group(3))
    raise AssertionError(f"{name} {labels} not in the scrape")


def test_both_daemons_serve_metrics_that_promtool_accepts(
    tmp_path, docker_engine, pki, gpus, nvml_lib, containers
):
    """A notice is answered on a node; then the agent's and the coordinator's /metrics are
    scraped: promtool finds nothing wrong, and the reclamation is counted on both."""
    coord = start_coordinator(tmp_path / "c", tls=pki, extra=("--metrics-listen", "127.0.0.1:0"))
    agent = None
    try:
        coord_port = re.search(r"metrics on \S+:(\d+)", coord.proc.log()).group(1)
        run_workload(
            docker_engine.client, name=containers + "job", node_id="node-a", kind="exits_on_term"
        )
        agent = start_agent(
            tmp_path,
            "node-a",
            coord,
            docker_engine.host,
            gpus,
            nvml_lib,
            AgentOptions(grace_s=2.0, overrun_s=1.0, extra=["--metrics-listen", "127.0.0.1:0"]),
        )
        agent_port = wait_until(
            lambda: re.search(r"metrics on \S+:(\d+)", agent.proc.log()), 10, "the agent's metrics"
        ).group(1)
        agent.write_notice({"id": "m-1", "action": "terminate", "terminate_at": time.time() + 6})
        coord.admin().wait_for("drained", node="node-a", timeout=20)
        for port in (agent_port, coord_port):
            text = scrape(f"http://127.0.0.1:{port}/metrics")
            promtool_check(text)
            assert (
                sample(text, "spotdrain_reclamations_total", reason="notice", outcome="drained")
                == 1.0
            )
            assert sample(text, "spotdrain_notice_to_sigterm_seconds_count", reason="notice") == 1.0
            assert sample(text, "spotdrain_local_taints_total") == 0.0
        coord_text = scrape(f"http://127.0.0.1:{coord_port}/metrics")
        assert sample(coord_text, "spotdrain_nodes_connected") == 1.0
        assert sample(coord_text, "spotdrain_workers", state="draining") == 0.0
    finally:
        if agent is not None:
            agent.proc.stop()
        coord.proc.stop()
