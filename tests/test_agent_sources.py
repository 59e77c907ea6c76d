"""Which notice sources an agent runs, and what it does with an advisory. Pure: the config
parser, DMI directories written by the test, and the advisory book under a fake clock."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness import BIN
from spotdrain.agent import config
from spotdrain.agent.core.advisories import AdvisoryBook, Drain, Record
from spotdrain.agent.notices.base import Advisory
from spotdrain.agent.notices.settings import AdvisoryPolicy, detect_cloud
from spotdrain.runtime.cli import UsageError

BASE = {"coordinator": "c:1", "node_id": "n", "insecure": True}

# What each cloud's VMs show under /sys/class/dmi/id (the files auto reads).
DMI = {
    "aws": {
        "sys_vendor": "Amazon EC2\n",
        "product_name": "g5.xlarge\n",
        "board_asset_tag": "i-0123456789abcdef0\n",
    },
    "aws-xen": {"product_uuid": "EC2E1916-9099-7CAF-FD21-012345ABCDEF\n", "sys_vendor": "Xen\n"},
    "gcp": {"sys_vendor": "Google\n", "product_name": "Google Compute Engine\n"},
    "azure": {
        "sys_vendor": "Microsoft Corporation\n",
        "product_name": "Virtual Machine\n",
        "chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77\n",
    },
    "hyper-v on premises": {
        "sys_vendor": "Microsoft Corporation\n",
        "product_name": "Virtual Machine\n",
        "chassis_asset_tag": "None\n",
    },
    "bare metal": {"sys_vendor": "Supermicro\n", "product_name": "SYS-4029GP-TRT\n"},
}
EXPECTED = {
    "aws": "aws",
    "aws-xen": "aws",
    "gcp": "gcp",
    "azure": "azure",
    "hyper-v on premises": "",
    "bare metal": "",
}


def dmi_dir(tmp_path: Path, machine: str) -> Path:
    d = tmp_path / machine.replace(" ", "_")
    d.mkdir()
    for name, text in DMI[machine].items():
        (d / name).write_text(text)
    return d


@pytest.mark.parametrize("machine", list(DMI))
def test_auto_turns_on_the_cloud_its_dmi_shows_plus_file_and_shutdown(tmp_path, machine):
    directory = dmi_dir(tmp_path, machine)
    assert detect_cloud(directory) == EXPECTED[machine]
    cfg = config.from_sources({}, {**BASE, "sources": {"dmi_dir": str(directory)}})
    want = ["file", EXPECTED[machine], "shutdown"] if EXPECTED[machine] else ["file", "shutdown"]
    assert list(cfg.source_configs) == sorted(
        want, key=["file", "aws", "gcp", "azure", "shutdown"].index
    )


def test_auto_false_runs_exactly_the_tables_given_with_their_settings(tmp_path):
    cfg = config.from_sources(
        {},
        {
            **BASE,
            "sources": {
                "auto": False,
                "dmi_dir": str(dmi_dir(tmp_path, "gcp")),
                "aws": {"endpoint": "http://127.0.0.1:9", "poll_s": 0.5},
            },
        },
    )
    assert list(cfg.source_configs) == ["aws"]
    assert cfg.source_configs["aws"].endpoint == "http://127.0.0.1:9"
    assert cfg.source_configs["aws"].poll_s == 0.5


def test_the_notice_file_flag_is_the_file_sources_path():
    cfg = config.from_sources(
        {"notice_file": "/x/flag.json"}, {**BASE, "sources": {"file": {"path": "/x/table.json"}}}
    )
    assert cfg.source_configs["file"].path == Path("/x/flag.json")
    cfg = config.from_sources({}, {**BASE, "sources": {"file": {"path": "/x/table.json"}}})
    assert cfg.source_configs["file"].path == Path("/x/table.json")
    cfg = config.from_sources({"sources": "file"}, BASE)
    assert list(cfg.source_configs) == ["file"]
    assert cfg.source_configs["file"].path == Path("/run/spotdrain/notice.json")


@pytest.mark.parametrize(
    "sources, message",
    [
        ({"auto": False}, "no [sources.NAME] table is given"),
        ({"openstack": {}}, "unknown notice source sources.openstack"),
        ({"aws": "yes"}, "[sources.aws] must be a table"),
        ({"auto": "yes"}, "sources.auto must be true or false"),
        ({"azure": {"endpoint": "https://169.254.169.254"}}, "must be http://HOST[:PORT]"),
    ],
)
def test_a_bad_sources_table_is_one_clear_error(sources, message):
    with pytest.raises(UsageError) as e:
        config.from_sources({}, {**BASE, "sources": sources})
    assert message in str(e.value)


def test_a_wrong_endpoint_is_one_line_and_exit_2_at_start(tmp_path):
    toml = tmp_path / "agent.toml"
    toml.write_text(
        'coordinator = "c:1"\nnode_id = "n"\ninsecure = true\n'
        '[sources]\nauto = false\n[sources.aws]\nendpoint = "169.254.169.254"\n'
    )
    run = subprocess.run(
        [str(BIN / "spotdrain-agent"), "--config", str(toml)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 2
    [line] = run.stderr.strip().splitlines()
    assert "sources.aws.endpoint must be http://HOST[:PORT]" in line


@pytest.mark.parametrize(
    "advisory, message",
    [
        ({"action": "evacuate"}, "advisory.action must be one of prepare, drain, ignore"),
        ({"ttl_s": float("nan")}, "advisory.ttl_s must be between"),
        ({"ttl_s": 0}, "advisory.ttl_s must be between"),
        ({"tll_s": 5}, "unknown setting advisory.tll_s"),
    ],
)
def test_a_bad_advisory_table_is_one_clear_error(advisory, message):
    with pytest.raises(UsageError, match=message):
        config.from_sources(
            {}, {**BASE, "sources": {"auto": False, "file": {}}, "advisory": advisory}
        )


# --- the advisory book -------------------------------------------------------------------------

REBALANCE = Advisory("aws:rebalance:t1", "aws", "rebalance")


def test_an_advisory_is_received_once_and_lifted_at_its_ttl():
    book = AdvisoryBook(AdvisoryPolicy("prepare", ttl_s=1800))
    [received] = book.handle(REBALANCE, 1000.0)
    assert received == Record(
        "advisory_received",
        {
            "source": "aws",
            "reason": "rebalance",
            "key": "aws:rebalance:t1",
            "action": "prepare",
            "expires_at": 2800.0,
            "not_before": None,
            "detail": "",
        },
    )
    assert book.handle(REBALANCE, 1001.0) == []  # read again next poll: nothing new
    assert book.next_expiry() == 2800.0
    assert book.handle(None, 2799.9) == []
    assert book.handle(None, 2800.0) == [
        Record(
            "advisory_lifted",
            {"source": "aws", "reason": "rebalance", "key": "aws:rebalance:t1", "why": "ttl"},
        )
    ]
    # AWS keeps showing the recommendation: a lifted advisory never comes back, not even
    # after a restart (the book is saved and read back).
    assert book.handle(REBALANCE, 2801.0) == []
    again = AdvisoryBook(AdvisoryPolicy("prepare", ttl_s=1800), book.saved())
    assert again.handle(REBALANCE, 2802.0) == [] and again.next_expiry() is None


def test_a_withdrawn_advisory_is_lifted_and_a_withdrawal_alone_is_nothing():
    book = AdvisoryBook(AdvisoryPolicy())
    assert book.handle(Advisory("k", "gcp", "migrate", withdrawn=True), 1.0) == []
    book.handle(Advisory("k", "gcp", "migrate"), 2.0)
    [lifted] = book.handle(Advisory("k", "gcp", "migrate", withdrawn=True), 3.0)
    assert lifted.kind == "advisory_lifted" and lifted.details["why"] == "withdrawn"
    assert book.active() == []


def test_drain_opens_a_reclamation_at_not_before_and_ignore_does_nothing():
    book = AdvisoryBook(AdvisoryPolicy("drain"))
    commands = book.handle(Advisory("azure:e1", "azure", "reboot", not_before=1300.0), 1000.0)
    assert [type(c) for c in commands] == [Record, Drain]
    notice = commands[1].notice
    assert (notice.key, notice.terminate_at, notice.action) == (
        "advisory:azure:e1",
        1300.0,
        "terminate",
    )
    assert AdvisoryBook(AdvisoryPolicy("ignore")).handle(REBALANCE, 1.0) == []


def test_a_saved_book_from_another_version_loses_only_the_bad_entry():
    saved = {
        "good": {
            "key": "good",
            "source": "aws",
            "reason": "rebalance",
            "received_at": 1.0,
            "expires_at": 99.0,
        },
        "bad": {"key": "bad", "colour": "blue"},
    }
    book = AdvisoryBook(AdvisoryPolicy(), saved)
    assert [e.key for e in book.active()] == ["good"]


async def test_the_units_status_line_names_a_broken_source_first(tmp_path):
    """`systemctl status` shows the agent's STATUS= line: a source that is down leads it, and
    the event for it is in the outbox for the coordinator."""
    from spotdrain.agent.daemon import Agent

    cfg = config.from_sources(
        {"sources": "file,aws"},
        {
            **BASE,
            "state_dir": str(tmp_path / "state"),
            "notice_file": str(tmp_path / "n.json"),
            "socket": str(tmp_path / "a.sock"),
            "deadline_file": str(tmp_path / "w" / "d.json"),
            "status_dir": str(tmp_path / "status"),
        },
    )
    agent = Agent(cfg)
    try:
        assert agent.node_status.describe().startswith(
            f"watching {tmp_path / 'n.json'}, aws; 0 workers"
        )
        for _ in range(3):
            agent.sources.sources["aws"].health.failed("GET /latest/api/token: refused")
        assert agent.node_status.describe().startswith(
            "notice source down: aws (GET /latest/api/token: refused); watching "
        )
        [(kind, details)] = [(e.kind, e.details) for e in agent.outbox.pending(10)]
        assert kind == "notice_source_down" and details["source"] == "aws"
    finally:
        await agent.shutdown()


async def test_settled_waits_for_the_outbox_but_never_past_o(tmp_path):
    """The shutdown source releases logind's lock when `settled` returns: by then the
    reclamation's events must have left the outbox, or O must have come."""
    import asyncio

    from spotdrain.agent.core.reclamation import reclaim_id_for
    from spotdrain.agent.notices.hub import SourceHub

    class Drains:
        live: dict = {}
        recent: dict = {}

        async def settled(self, key):
            return "drained"

    class Rec:
        overrun_at = 0.0

    now = [100.0]
    pending = [3]
    drains = Drains()
    hub = SourceHub(
        "n",
        drains,
        AdvisoryPolicy(),
        tmp_path,
        clock=lambda: now[0],
        undelivered=lambda: pending[0],
    )
    rec = Rec()
    rec.overrun_at = 130.0
    drains.recent[reclaim_id_for("n", "shutdown:boot")] = rec
    waiting = asyncio.create_task(hub.settled("shutdown:boot"))
    # Three events still in the outbox, O not yet come: it is still waiting after several
    # of its looks at the outbox (each DELIVERY_CHECK_S).
    looked = 0
    while looked < 5:
        await asyncio.sleep(0.02)
        looked += 1
        assert not waiting.done()
    pending[0] = 0
    assert await asyncio.wait_for(waiting, 2) == "drained"
    pending[0] = 5
    now[0] = 130.0  # at O it returns whatever is left undelivered
    assert await asyncio.wait_for(hub.settled("shutdown:boot"), 2) == "drained"
