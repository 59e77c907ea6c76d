"""The Grafana dashboard and the Prometheus alerting rules in packaging/, held to the code:
promtool parses every PromQL expression of both (and of the dashboard's variables), `promtool
test rules` runs the alerts' unit tests, and every spotdrain metric either file names is one that
a real agent or coordinator exports, scraped from the running daemons (no Docker needed).

promtool comes from tests/setup.sh (Debian's prometheus package); without it these tests fail
rather than skip."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from fakes.fakenvml import FakeGpus
from fakes.harness import AgentOptions, start_agent, start_coordinator
from fakes.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "packaging" / "grafana" / "spotdrain.json"
RULES = REPO / "packaging" / "prometheus" / "spotdrain-alerts.yml"
# Two files: the 7-day overrun budget evaluated hourly, the rest minute by minute (one file
# evaluated every minute over 7 days would take promtool a minute).
RULES_TESTS = [
    REPO / "packaging" / "prometheus" / name
    for name in ("spotdrain-alerts.test.yml", "spotdrain-alerts-minutes.test.yml")
]

# Grafana's own variables, replaced by a value of the right kind before promtool reads a query.
GRAFANA_BUILTINS = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
    "__range_s": "3600",
    "__interval_ms": "60000",
}
# What the alerts must cover (issue 14): overrun budget, local taint, source down, coordinator
# not reachable from agents.
ALERTS = {
    "SpotdrainOverrunBudgetExceeded",
    "SpotdrainLocalTaint",
    "SpotdrainNoticeSourceDown",
    "SpotdrainCoordinatorUnreachable",
}
# Metrics the files may name that no spotdrain daemon exports: Prometheus's own.
PROMETHEUS_OWN = {"up"}


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: run tests/setup.sh as root (Debian's prometheus package)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


# --- what the two files hold ------------------------------------------------------------------


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))  # a collapsed row holds its panels


def variable_values(dash: dict) -> dict[str, str]:
    """Each template variable's name, with a value that makes a valid PromQL text."""
    values = dict(GRAFANA_BUILTINS)
    for var in dash["templating"]["list"]:
        values[var["name"]] = ".*" if var.get("includeAll") or var.get("multi") else "x"
    return values


def substitute(expr: str, values: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in values, f"unknown variable ${name} in {expr!r}"
        return values[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", one, expr)


def dashboard_exprs() -> dict[str, str]:
    """Every PromQL text of the dashboard, by where it is: panel targets and the query
    variables (`label_values(SELECTOR, label)` and `query_result(EXPR)` are Grafana's, around
    PromQL), template variables replaced."""
    dash = dashboard()
    values = variable_values(dash)
    out: dict[str, str] = {}
    for panel in all_panels(dash["panels"]):
        for target in panel.get("targets", []):
            key = f"panel {panel['id']} ({panel['title']}) target {target['refId']}"
            out[key] = substitute(target["expr"], values)
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.*),\s*\w+\)|query_result\((.*)\)", query.strip())
        assert m, f"variable {var['name']}: a query promtool cannot check: {query!r}"
        out[f"variable {var['name']}"] = substitute(m.group(1) or m.group(2), values)
    return out


def rules_exprs() -> dict[str, str]:
    doc = yaml.safe_load(RULES.read_text())
    return {
        rule.get("alert") or rule["record"]: rule["expr"]
        for group in doc["groups"]
        for rule in group["rules"]
    }


def check_exprs(exprs: dict[str, str], tmp: Path) -> subprocess.CompletedProcess[str]:
    """promtool parses each expression, as a recording rule of a generated rules file."""
    rules = [
        {"record": f"dashboard:expr_{i}", "expr": expr} for i, expr in enumerate(exprs.values())
    ]
    path = tmp / "dashboard-exprs.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    return promtool("check", "rules", str(path))


def metric_names(expr: str) -> set[str]:
    """The metric names an expression uses: identifiers followed by a selector, a range or
    an operator, less PromQL's functions, keywords and label names inside braces or by()."""
    no_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    no_braces = re.sub(r"\{[^}]*\}", "{}", no_strings)
    no_grouping = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", no_braces
    )
    names = set()
    for m in re.finditer(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?", no_grouping):
        word, call = m.group(1), m.group(2)
        if call or word in {"and", "or", "unless", "bool", "offset", "inf", "nan"}:
            continue
        if re.fullmatch(r"\d+[smhdwy]", word) or word in {"s", "m", "h", "d", "w", "y"}:
            continue
        names.add(word)
    return names


# --- the daemons as they run --------------------------------------------------------------------


def scrape(port: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def exported(text: str) -> set[str]:
    """The sample names a scrape's families stand for, whether or not they have samples yet
    (a labelled histogram nobody observed has only its TYPE line)."""
    names = set()
    for m in re.finditer(r"^# TYPE (\S+) (\w+)$", text, re.M):
        name, kind = m.groups()
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def sample(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}(?:\{{\}})? (\S+)$", text, re.M)
    return None if m is None else float(m.group(1))


@pytest.fixture
def daemons(tmp_path, nvml_lib):
    """A coordinator and one agent, both serving /metrics. The agent has no Docker engine: it
    warns and retries the engine, while everything that makes metrics runs."""
    coord = start_coordinator(tmp_path / "c", extra=("--metrics-listen", "127.0.0.1:0"))
    agent = None
    try:
        gpus = FakeGpus(tmp_path / "gpus.state")
        gpus.set(gpus=1)
        agent = start_agent(
            tmp_path,
            "node-a",
            coord,
            f"unix://{tmp_path}/no-docker.sock",
            gpus,
            nvml_lib,
            AgentOptions(extra=["--metrics-listen", "127.0.0.1:0"]),
        )
        ports = {
            name: wait_until(
                lambda p=proc: re.search(r"metrics on \S+:(\d+)", p.log()),
                10,
                f"the {name}'s metrics",
            ).group(1)
            for name, proc in (("coordinator", coord.proc), ("agent", agent.proc))
        }
        yield coord, agent, ports
    finally:
        if agent is not None:
            agent.proc.stop()
        coord.proc.stop()


# --- the tests ------------------------------------------------------------------------------------


def test_the_alert_rules_pass_promtool_check_rules():
    run = promtool("check", "rules", str(RULES))
    assert run.returncode == 0, run.stdout + run.stderr
    assert ALERTS <= set(rules_exprs()), "an alert issue 14 asks for is missing"


def test_the_alert_rules_pass_their_unit_tests():
    """packaging/prometheus/spotdrain-alerts*.test.yml: the overrun budget fires at 2 in 200,
    not at 1 in 400, not under 200 reclamations; a source down, a local taint, an agent cut
    from the coordinator."""
    run = promtool("test", "rules", *(p.name for p in RULES_TESTS), cwd=RULES_TESTS[0].parent)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("SUCCESS") == len(RULES_TESTS), run.stdout
    tested = {
        t["alertname"]
        for path in RULES_TESTS
        for case in yaml.safe_load(path.read_text())["tests"]
        for t in case.get("alert_rule_test", [])
    }
    assert ALERTS <= tested


def test_every_dashboard_expression_passes_promtool(tmp_path):
    dash = dashboard()
    assert dash["schemaVersion"] >= 36
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names[0] == "datasource" and dash["templating"]["list"][0]["query"] == "prometheus"
    for panel in all_panels(dash["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel.get("targets"), f"panel {panel['title']} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    kinds = {p["type"] for p in all_panels(dash["panels"])}
    assert "heatmap" in kinds
    exprs = dashboard_exprs()
    run = check_exprs(exprs, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in run.stdout


def test_the_expression_check_finds_a_broken_expression(tmp_path):
    """The check above can fail: one bad expression among good ones is reported."""
    exprs = {**dashboard_exprs(), "broken": "sum by (le) (rate(spotdrain_x_bucket[5m])"}
    run = check_exprs(exprs, tmp_path)
    assert run.returncode != 0
    with pytest.raises(AssertionError, match="unknown variable"):
        substitute('up{instance=~"$nosuchvariable"}', variable_values(dashboard()))


def test_every_metric_named_is_one_the_daemons_export(daemons):
    """A metric renamed or dropped in the code, or misspelt in packaging/, fails here: each
    name in the dashboard and the rules must be in a live agent's or coordinator's scrape."""
    _coord, _agent, ports = daemons
    have = exported(scrape(ports["agent"])) | exported(scrape(ports["coordinator"]))
    assert "spotdrain_reclamations_total" in have and "spotdrain_gc_pause_seconds_bucket" in have
    used: dict[str, set[str]] = {}
    for where, expr in {**dashboard_exprs(), **rules_exprs()}.items():
        for name in metric_names(expr):
            used.setdefault(name, set()).add(where)
    assert "spotdrain_notice_source_up" in used and "up" in used  # the parser sees names
    unknown = {
        name: sorted(where)
        for name, where in used.items()
        if name not in have and name not in PROMETHEUS_OWN
    }
    assert not unknown, f"metrics no daemon exports: {unknown}"


def test_the_agent_says_whether_it_reaches_the_coordinator(daemons):
    """spotdrain_coordinator_connected (what SpotdrainCoordinatorUnreachable watches): 1 while
    the agent's stream is registered, 0 once the coordinator is gone; and the outcome counters
    are there at 0 before any reclamation, so increase() sees the first overrun."""
    coord, _agent, ports = daemons
    # The metrics port opens before the stream is registered: wait for the registration.
    wait_until(
        lambda: sample(scrape(ports["agent"]), "spotdrain_coordinator_connected") == 1.0,
        15,
        "the agent to register with the coordinator",
    )
    text = scrape(ports["agent"])
    for outcome in ("drained", "overrun"):
        assert (
            f'spotdrain_reclamations_total{{outcome="{outcome}",reason="notice"}} 0.0' in text
            or f'spotdrain_reclamations_total{{reason="notice",outcome="{outcome}"}} 0.0' in text
        )
    coord.proc.stop()
    wait_until(
        lambda: sample(scrape(ports["agent"]), "spotdrain_coordinator_connected") == 0.0,
        15,
        "the agent to see the coordinator gone",
    )


def test_the_coordinator_package_ships_both_files():
    """debian/spotdrain-coordinator.install puts the dashboard and the rules under
    /usr/share/spotdrain/ (the packaged install itself is tests/e2e/test_packaging.py's)."""
    lines = (REPO / "packaging/debian/spotdrain-coordinator.install").read_text().splitlines()
    shipped = {src: dest for src, dest in (line.split() for line in lines if line.strip())}
    assert shipped[str(DASHBOARD.relative_to(REPO))] == "usr/share/spotdrain/grafana/"
    assert shipped[str(RULES.relative_to(REPO))] == "usr/share/spotdrain/prometheus/"
