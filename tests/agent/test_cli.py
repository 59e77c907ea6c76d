"""Operators' scripts call these commands: a bad flag or config is one clear line and exit 2;
every agent flag has a place in the TOML file; spotctl prints what the coordinator stored."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from fakes.harness import BIN
from spotdrain.agent import config
from spotdrain.runtime.cli import UsageError

BASE = [
    "--coordinator",
    "127.0.0.1:7000",
    "--node-id",
    "n1",
    "--notice-file",
    "/tmp/n.json",
    "--state-dir",
    "/tmp/s",
    "--docker-host",
    "unix:///var/run/docker.sock",
    "--insecure",
]


def run(prog: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / prog), *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (BASE[2:], "missing --coordinator"),
        (BASE[:-1], "give --tls-cert, --tls-key and --ca, or --insecure"),
        ([*BASE, "--grace-s", "ten"], "--grace-s must be a number"),
        ([*BASE, "--grace-s", "1", "--overrun-s", "2"], "overrun margin <= grace margin"),
        (["--coordinator", "nohost", *BASE[2:]], "--coordinator must be HOST:PORT"),
        ([*BASE[:8], "--docker-host", "tcp://x:2375", "--insecure"], "unix:///PATH"),
        ([*BASE, "--config", "/nonexistent.toml"], "cannot read config /nonexistent.toml"),
    ],
)
def test_agent_bad_flags_give_one_line_and_exit_2(args, message):
    result = run("spotdrain-agent", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spotdrain-agent: error: ")
    assert message in lines[0]


@pytest.mark.parametrize(
    "body, message",
    [
        (None, "--acquirers {path}: No such file"),
        ("this is not toml", "--acquirers {path}: "),
        ("[groups.b]\nexec = []", "exec must be a non-empty list"),
        ("avoid_s = -5", "avoid_s must be positive"),
        ("[groups.b]\nwebhook = 'ftp://x'", "http:// or https:// URL"),
    ],
)
def test_coordinator_bad_acquirers_file_gives_one_line_and_exit_2(tmp_path, body, message):
    """Nothing starts on a bad file: no store opened for serving, no port bound."""
    path = tmp_path / "acquirers.toml"
    if body is not None:
        path.write_text(body)
    result = run(
        "spotdrain-coordinator",
        "--listen",
        "127.0.0.1:0",
        "--db",
        str(tmp_path / "c.sqlite"),
        "--insecure",
        "--acquirers",
        str(path),
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if "WARNING" not in line]
    assert len(lines) == 1 and lines[0].startswith("spotdrain-coordinator: error: ")
    assert message.format(path=path) in lines[0]
    assert "listening" not in result.stdout


def test_every_agent_flag_has_a_place_in_the_config_file(tmp_path):
    toml = tmp_path / "agent.toml"
    toml.write_text(
        """
coordinator = "10.0.0.1:7443"
node_id = "gpu-17"
notice_file = "/run/spotdrain/notice.json"
state_dir = "/var/lib/spotdrain"
docker_host = "unix:///run/docker.sock"
tls_cert = "/etc/spotdrain/node.pem"
tls_key = "/etc/spotdrain/node.key"
ca = "/etc/spotdrain/ca.pem"
node_group = "eu-west-a"
spot = false
deadline_file = "/run/spotdrain/workload/deadline.json"
docker_call_timeout_s = 1.5
nvml_timeout_s = 3
notice_poll_s = 2
inventory_every_s = 10
log_level = "WARNING"

[margins]
default_notice_s = 120
grace_s = 10
overrun_s = 2
taint_answer_s = 0.8
observe_every_s = 0.5
"""
    )
    cfg = config.load(["--config", str(toml)])
    assert cfg.node_id == "gpu-17" and cfg.spot is False and cfg.nvml_timeout_s == 3.0
    assert cfg.margins.grace_s == 10 and cfg.tls_cert == "/etc/spotdrain/node.pem"
    flags = {a.dest for a in config.parser()._actions} - {"help", "config"}
    in_file = set(config.SETTINGS) | {"insecure", "spot"} | set(config.MARGINS)
    # --sources and --dmi-dir stand for the [sources] table: its source names, and dmi_dir.
    assert flags == in_file | {"sources", "dmi_dir"}
    # Flags win over the file.
    assert config.load(["--config", str(toml), "--node-id", "gpu-18"]).node_id == "gpu-18"


@pytest.mark.parametrize(
    "body, message",
    [
        ("node_idd = 'x'", "unknown setting node_idd"),
        ("[margins]\ngrace = 3", "unknown setting margins.grace"),
        ("spot = 'yes'", "spot must be true or false"),
        ("nvml_timeout_s = -1", "nvml_timeout_s must be positive"),
        ("this is not toml", "config"),
        ("[workloads]\ndocker = 'yes'", "workloads.docker must be true or false"),
        ("[workloads]\npbs = true", "unknown setting workloads.pbs"),
        ("[workloads]\ndocker = false", "turns every backend off"),
        ("[workloads.slurm]\nnode_name = 'a b'", "node_name must be a Slurm node name"),
        ("[workloads.slurm]\nbin_dir = '/nonexistent'", "has no executable scontrol"),
        ("[workloads.slurm]\nbin_dir = 'usr/bin'", "must be an absolute path"),
        ("[workloads.slurm]\nconf = '/nonexistent/slurm.conf'", "is not a readable file"),
        (
            "[workloads.slurm]\nconf = '{conf}'\ncall_timeout_s = nan",
            "call_timeout_s must be a number",
        ),
        (
            "[workloads.slurm]\nconf = '{conf}'\ncall_timeout_s = inf",
            "call_timeout_s must be a number",
        ),
        (
            "[workloads.slurm]\nconf = '{conf}'\ncall_timeout_s = 0",
            "call_timeout_s must be a number",
        ),
        ("[workloads.slurm]\nconf = '{conf}'\nrequeue = 1", "requeue must be true or false"),
        ("[workloads.slurm]\nnodename = 'x'", "nodename: unknown setting"),
    ],
)
def test_bad_config_file_is_one_clear_error(tmp_path, body, message):
    slurm_conf = tmp_path / "slurm.conf"  # a readable one, for the keys checked after it
    slurm_conf.write_text("ClusterName=test\n")
    toml = tmp_path / "agent.toml"
    toml.write_text(body.replace("{conf}", str(slurm_conf)))
    with pytest.raises(UsageError, match=message):
        config.load([*BASE, "--config", str(toml)])


def test_spotctl_without_coordinator_is_a_usage_error():
    result = run("spotctl", "events", "--json")
    assert result.returncode == 2
    assert result.stderr.strip() == "spotctl: error: --coordinator HOST:PORT is required"


def test_spotctl_events_and_timeline(tmp_path, pki, coordinator):
    """An operator reads the event log as JSON lines from an id, and a reclamation as a table."""
    from spotdrain.v1 import spotdrain_pb2 as pb
    from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

    stub = pb_grpc.AgentLinkStub(coordinator.channel(pki.issue("node:node-a")))
    t0 = time.time()
    evs = [
        (
            "notice_received",
            0.0,
            {
                "notice_id": "i-1",
                "source": "aws-imds",
                "reason": "notice",
                "t0": t0,
                "terminate_at": t0 + 30,
                "grace_deadline": t0 + 20,
                "overrun_at": t0 + 28,
            },
        ),
        ("tainted", 0.004, {"mode": "remote"}),
        ("sigterm_sent", 0.012, {"name": "job", "container": "c" * 64, "via": "api"}),
        ("container_exited", 1.5, {"name": "job", "exit_code": 0}),
        ("verified_empty", 1.6, {}),
        ("drained", 1.6, {"spare_s": 28.4}),
    ]

    def messages():
        yield pb.AgentMessage(register=pb.Register(node_id="node-a"))
        batch = [
            pb.Event(
                uid=f"u{i}",
                kind=k,
                node_id="node-a",
                reclaim_id="rcl-1",
                wall_time=t0 + dt,
                t_offset_s=dt,
                details_json=json.dumps(d),
            )
            for i, (k, dt, d) in enumerate(evs)
        ]
        yield pb.AgentMessage(events=pb.EventBatch(events=batch))

    list(stub.Connect(messages(), timeout=5))
    result = run("spotctl", *coordinator.cli_args(), "events", "--json")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [e["kind"] for e in lines] == [k for k, _, _ in evs]
    assert lines[3]["exit_code"] == 0 and lines[3]["node"] == "node-a"
    after = run(
        "spotctl", *coordinator.cli_args(), "events", "--json", "--from", str(lines[3]["id"])
    )
    assert [json.loads(x)["kind"] for x in after.stdout.splitlines()] == [
        "verified_empty",
        "drained",
    ]
    table = run("spotctl", *coordinator.cli_args(), "timeline")
    assert table.returncode == 0, table.stderr
    out = table.stdout
    assert "reclamation rcl-1" in out and "D T+30.000s" in out
    assert "T+0.004s  tainted" in out and "mode=remote" in out
    assert "28.400 s to spare" in out
    js = json.loads(run("spotctl", *coordinator.cli_args(), "timeline", "rcl-1", "--json").stdout)
    assert js["outcome"] == "drained" and len(js["events"]) == len(evs)
    missing = run("spotctl", *coordinator.cli_args(), "timeline", "rcl-nope")
    assert missing.returncode == 1 and "no reclamation 'rcl-nope'" in missing.stderr


def test_spotctl_timeline_shows_a_tenants_file_name_escaped(pki, coordinator):
    """A job names a report file with an ESC sequence that sets the terminal's title, one that
    clears the screen, a BEL, a C1 CSI and a byte that is not UTF-8; the agent reports it
    invalid. The operator reads the timeline's table: every one of them is shown as an
    escape, the terminal gets nothing to act on, and the row is still one row. --json keeps
    the name as JSON escapes it."""
    from spotdrain.v1 import spotdrain_pb2 as pb
    from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

    stub = pb_grpc.AgentLinkStub(coordinator.channel(pki.issue("node:node-a")))
    t0 = time.time()
    hostile = "\x1b]0;owned\x07\x1b[2J\x9b31m\n" + os.fsdecode(b"\xff") + ".json"
    evs = [
        (
            "notice_received",
            0.0,
            {
                "notice_id": "i-1",
                "source": "aws-imds",
                "reason": "notice",
                "t0": t0,
                "terminate_at": t0 + 30,
                "grace_deadline": t0 + 20,
                "overrun_at": t0 + 28,
            },
        ),
        ("workload_report_invalid", 0.5, {"name": "job", "file": hostile, "reason": "not JSON"}),
    ]

    def messages():
        yield pb.AgentMessage(register=pb.Register(node_id="node-a"))
        batch = [
            pb.Event(
                uid=f"u{i}",
                kind=k,
                node_id="node-a",
                reclaim_id="rcl-esc",
                wall_time=t0 + dt,
                t_offset_s=dt,
                details_json=json.dumps(d),
            )
            for i, (k, dt, d) in enumerate(evs)
        ]
        yield pb.AgentMessage(events=pb.EventBatch(events=batch))

    list(stub.Connect(messages(), timeout=5))
    table = subprocess.run(
        [str(BIN / "spotctl"), *coordinator.cli_args(), "timeline", "rcl-esc"],
        capture_output=True,
        timeout=30,
    )  # bytes: what reaches the terminal
    assert table.returncode == 0, table.stderr
    out = table.stdout.decode("utf-8")
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out
    assert all(line.isprintable() for line in out.split("\n"))
    (row,) = [line for line in out.split("\n") if "workload_report_invalid" in line]
    assert r"file=\x1b]0;owned\x07\x1b[2J\u009b31m\x0a\xff.json" in row
    js = run("spotctl", *coordinator.cli_args(), "timeline", "rcl-esc", "--json")
    assert json.loads(js.stdout)["events"][1]["file"] == hostile


# A proto string is UTF-8 on the wire; a byte that is not reaches spotctl inside JSON (an
# event's details, the agent's status) as a surrogate escape.
WIRE_HOSTILE = "\x1b[2J\x07\x9b\u202e\n"
HOSTILE = WIRE_HOSTILE + os.fsdecode(b"\xfe")


def hostile(msg, depth: int = 0):
    """`msg` with every string field, at any depth, set to WIRE_HOSTILE (one element in each
    repeated message field, one entry in each map)."""
    from google.protobuf.descriptor import FieldDescriptor as F

    for f in msg.DESCRIPTOR.fields:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            getattr(msg, f.name)[WIRE_HOSTILE] = (
                WIRE_HOSTILE
                if f.message_type.fields_by_name["value"].type == F.TYPE_STRING
                else 1.0
            )
        elif f.type == F.TYPE_MESSAGE and depth < 3:
            child = getattr(msg, f.name).add() if f.is_repeated else getattr(msg, f.name)
            hostile(child, depth + 1)
        elif f.type == F.TYPE_STRING:
            if f.is_repeated:
                getattr(msg, f.name).append(WIRE_HOSTILE)
            else:
                setattr(msg, f.name, WIRE_HOSTILE)
    return msg


def test_every_table_spotctl_prints_escapes_every_field():
    """Whatever field of a coordinator's answer a tenant or a node can fill (a name, a reason,
    an image, a detail), every plain table and status line shows it escaped: each line of
    output printable, and no value starts a line of its own."""
    from spotdrain.agent.spotctl import main as spotctl
    from spotdrain.v1 import spotdrain_pb2 as pb

    tl = hostile(pb.Timeline())
    tl.events[0].event.details_json = json.dumps({"file": HOSTILE, HOSTILE: HOSTILE})
    status = {
        "node": HOSTILE,
        "state": HOSTILE,
        "paused": True,
        "drain": {
            "reclaim_id": HOSTILE,
            "reason": HOSTILE,
            "phase": HOSTILE,
            "grace_in_s": 1.0,
            "deadline_in_s": 2.0,
        },
        "sources": [{"source": HOSTILE, "up": False, "error": HOSTILE}],
        "at_risk": [{"reason": HOSTILE, "source": HOSTILE, "expires_at": 1.0}],
        "workers": [{"worker_id": HOSTILE, "state": HOSTILE, "slots_in_use": 1, "capacity": 2}],
        "rentals": [{"rental_id": HOSTILE}],
        "jobs": [{"kind": HOSTILE, "worker_id": HOSTILE, "draining": True}],
    }
    outputs = {
        "timeline": spotctl.render_timeline(tl),
        "nodes": spotctl.render_nodes([hostile(pb.Node())], 0.0),
        "rental": spotctl.render_rental(hostile(pb.Rental()), 0.0),
        "rentals": spotctl.render_rentals([hostile(pb.Rental())], 0.0),
        "reputation": spotctl.render_reputation(hostile(pb.Reputation())),
        "models": spotctl.render_models([hostile(pb.Model())]),
        "status": spotctl.render_status(status),
    }
    assert "\\x0a\\xfe" in outputs["timeline"] and "\\x0a\\xfe" in outputs["status"]
    for what, text in outputs.items():
        assert "\\x1b[2J\\x07\\u009b\\u202e\\x0a" in text, what
        assert all(line.isprintable() for line in text.split("\n")), what


def test_spotctl_follow_prints_new_events(pki, coordinator):
    follow = subprocess.Popen(
        [str(BIN / "spotctl"), *coordinator.cli_args(), "events", "--json", "--follow"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        from spotdrain.v1 import spotdrain_pb2 as pb
        from spotdrain.v1 import spotdrain_pb2_grpc as pb_grpc

        stub = pb_grpc.AgentLinkStub(coordinator.channel(pki.issue("node:node-a")))

        def messages():
            yield pb.AgentMessage(register=pb.Register(node_id="node-a"))
            yield pb.AgentMessage(
                events=pb.EventBatch(
                    events=[
                        pb.Event(
                            uid="late-1",
                            kind="notice_invalid",
                            node_id="node-a",
                            wall_time=time.time(),
                            details_json='{"reason": "not JSON"}',
                        )
                    ]
                )
            )

        list(stub.Connect(messages(), timeout=5))
        line = json.loads(follow.stdout.readline())
        assert line["kind"] == "notice_invalid" and line["reason"] == "not JSON"
    finally:
        follow.kill()


def test_proto_stubs_match_the_protos():
    """The committed stubs are what proto/generate.sh makes from the .proto files."""
    script = Path(__file__).parents[2] / "proto" / "generate.sh"
    result = subprocess.run([str(script), "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_packaged_config_file_names_every_setting_and_parses(tmp_path):
    """packaging/agent.toml is the operator's reference: uncommented, it must load, and it must
    mention every setting the agent has."""
    text = (Path(__file__).parents[2] / "packaging" / "agent.toml").read_text()
    for name in [*config.SETTINGS, "insecure", "spot", *config.MARGINS]:
        assert f"# {name} = " in text, name
    for key in ["sources.auto", "sources.dmi_dir", "advisory.action", "advisory.ttl_s"]:
        assert f"# {key.split('.')[1]} = " in text, key
    uncommented = re.sub(r"(?m)^# ([a-z_]+ = |\[sources\.[a-z]+\])", r"\1", text)
    toml = tmp_path / "agent.toml"
    toml.write_text(uncommented)
    cfg = config.load(["--config", str(toml)])
    assert cfg.node_id == "gpu-host-17" and cfg.margins.grace_s == 10.0
    # Every source's table is there to turn on, each with its defaults as shown.
    assert list(cfg.source_configs) == ["file", "aws", "gcp", "azure", "shutdown"]
    assert cfg.source_configs["aws"] == type(cfg.source_configs["aws"])()


def test_spotctl_workers_start_and_list(coordinator):
    """An operator's placement goes through the gate: an unknown node is refused with the
    reason, and the list shows what the coordinator holds."""
    refused = run(
        "spotctl",
        *coordinator.cli_args(),
        "workers",
        "start",
        "node-x",
        "--model",
        "m",
        "--image",
        "img",
    )
    assert refused.returncode == 1
    assert "FAILED_PRECONDITION" in refused.stderr and "unknown_node" in refused.stderr
    listed = run("spotctl", *coordinator.cli_args(), "workers", "list", "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == []
    table = run("spotctl", *coordinator.cli_args(), "workers", "list")
    assert table.returncode == 0 and table.stdout.split()[:3] == ["worker", "node", "model"]


def test_spotctl_status_without_an_agent_says_so(tmp_path):
    result = run("spotctl", "--socket", str(tmp_path / "none.sock"), "status")
    assert result.returncode == 1
    assert "cannot reach the agent" in result.stderr


def test_spotctl_status_shows_rentals_and_jobs():
    from spotdrain.agent.spotctl.render import render_status

    text = render_status(
        {
            "node": "node-a",
            "state": "draining",
            "paused": True,
            "drain": {
                "reclaim_id": "rcl-1",
                "reason": "pause",
                "phase": "draining",
                "grace_in_s": 5.0,
                "deadline_in_s": 8.0,
            },
            "workers": [],
            "rentals": [{"rental_id": "r-1", "container": "c", "reclaim_at": 1795990000.0}],
            "jobs": [{"worker_id": "w-1", "kind": "render", "container": "c2", "draining": True}],
        }
    )
    assert "rental r-1: running, reclaim at 2026-11-29T" in text
    assert "render job w-1: draining" in text


def test_spotctl_status_names_a_broken_source_and_an_advisory():
    from spotdrain.agent.spotctl.render import render_status

    text = render_status(
        {
            "node": "node-a",
            "state": "available",
            "paused": False,
            "drain": None,
            "sources": [
                {"source": "file", "up": True, "error": "", "last_ok": 1795990000.0},
                {
                    "source": "aws",
                    "up": False,
                    "error": "GET ...: no answer in 0.5 s",
                    "last_ok": None,
                },
            ],
            "at_risk": [
                {"key": "k", "source": "aws", "reason": "rebalance", "expires_at": 1795990000.0}
            ],
        }
    )
    assert "notice source file: up, last read 2026-11-29T" in text
    assert "notice source aws: DOWN (GET ...: no answer in 0.5 s)" in text
    assert "at risk: rebalance from aws until 2026-11-29T" in text


def test_the_readme_edits_are_a_whole_agent_config():
    """A packaged agent.toml with only the coordinator, the node id and the TLS files starts:
    the paths a packaged daemon needs have defaults that match the unit's directories."""
    cfg = config.from_sources(
        {},
        {
            "coordinator": "coordinator.example.internal:7443",
            "node_id": "gpu-host-17",
            "tls_cert": "/etc/spotdrain/node.pem",
            "tls_key": "/etc/spotdrain/node.key",
            "ca": "/etc/spotdrain/ca.pem",
        },
    )
    assert cfg.notice_file == Path("/run/spotdrain/notice.json")
    assert cfg.state_dir == Path("/var/lib/spotdrain")
    assert cfg.docker_host == "unix:///run/docker.sock"
    unit = (Path(__file__).parents[2] / "packaging/systemd/spotdrain-agent.service").read_text()
    assert "StateDirectory=spotdrain" in unit and "RuntimeDirectory=spotdrain" in unit


@pytest.mark.parametrize(
    "args, message",
    [
        (["--docker-call-timeout-s", "nan"], "--docker-call-timeout-s must be a finite number"),
        (["--notice-poll-s", "inf"], "--notice-poll-s must be a finite number"),
        (["--pause-notice-s", "nan"], "--pause-notice-s must be a finite number"),
        (["--grace-s", "nan"], "--grace-s must be a finite number"),
        (["--overrun-s=-inf"], "--overrun-s must be a finite number"),
        (["--gate-port-offset", "inf"], "--gate-port-offset must be a finite number"),
    ],
)
def test_agent_nan_and_infinity_are_refused_at_start(args, message):
    """NaN never compares and infinity never fires: a deadline or timeout made of either would
    let a notice taint but never signal. One line, exit 2, before anything starts."""
    result = run("spotdrain-agent", *BASE, *args)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert message in line


def test_agent_margins_nan_in_the_file_and_a_non_utf8_file_are_one_line(tmp_path):
    nan = tmp_path / "nan.toml"
    nan.write_text(
        'coordinator = "c:1"\nnode_id = "n"\ninsecure = true\n[margins]\ngrace_s = nan\n'
    )
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'coordinator = "c:1"\nnode_id = "n\xe9"\n')
    for path, message in (
        (nan, "margins.grace_s must be a finite number"),
        (latin, "not UTF-8 at byte"),
    ):
        result = run("spotdrain-agent", "--config", str(path))
        assert result.returncode == 2, result.stderr
        [line] = result.stderr.strip().splitlines()
        assert message in line


@pytest.mark.parametrize(
    "args, message",
    [
        (["--heartbeat-ttl-s", "nan"], "argument --heartbeat-ttl-s: must be a finite number"),
        (["--node-gone-s", "inf"], "argument --node-gone-s: must be a finite number"),
        (["--node-lost-s", "nan"], "argument --node-lost-s: must be a finite number"),
        (["--node-lost-s", "0"], "argument --node-lost-s: must be a finite number between"),
        (["--start-timeout-s", "0"], "argument --start-timeout-s: must be a finite number between"),
        (
            ["--contract-budget", "1.5"],
            "argument --contract-budget: must be a finite number between",
        ),
    ],
)
def test_coordinator_nan_infinity_and_out_of_range_are_one_line(tmp_path, args, message):
    result = run(
        "spotdrain-coordinator",
        "--listen",
        "127.0.0.1:0",
        "--db",
        str(tmp_path / "c.sqlite"),
        "--insecure",
        *args,
    )
    assert result.returncode == 2
    errors = [ln for ln in result.stderr.splitlines() if ": error: " in ln]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "c.sqlite").exists()  # refused before the store was opened


def test_coordinator_on_a_port_in_use_is_one_line_and_exit_2(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run(
            "spotdrain-coordinator",
            "--listen",
            f"127.0.0.1:{port}",
            "--db",
            str(tmp_path / "c.sqlite"),
            "--insecure",
        )
    assert result.returncode == 2
    assert f"error: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
