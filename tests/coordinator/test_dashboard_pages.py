"""The dashboard's pages and flags without a browser: hostile strings from agents stay text,
and the coordinator refuses to show the fleet off loopback unless told to."""

from __future__ import annotations

import subprocess
from html.parser import HTMLParser

from fakes.harness import BIN
from spotdrain.coordinator.dashboard import pages
from spotdrain.coordinator.dashboard.app import is_loopback
from spotdrain.v1 import spotdrain_pb2 as pb

HOSTILE = '"><script>alert(1)</script><img src=x onerror=alert(2)>'


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append((tag, dict(attrs)))


def test_an_agents_hostile_names_are_text_on_the_fleet_page():
    """A node registers with markup in its id, group, work manager, cloud identity and a worker's
    model; an advisory key and a taint carry it too. The page has no element or handler it did
    not write."""
    node = pb.Node(
        node_id=HOSTILE,
        node_group=HOSTILE,
        spot=True,
        workload_enabled=True,
        taints=[pb.Taint(reason=HOSTILE, reclaim_id=HOSTILE)],
        managers=[pb.WorkManager(name=HOSTILE, node_name=HOSTILE, cluster=HOSTILE)],
        cloud=pb.CloudIdentity(
            provider=HOSTILE,
            instance_id=HOSTILE,
            region=HOSTILE,
            zone=HOSTILE,
            instance_type=HOSTILE,
        ),
    )
    worker = pb.WorkerInfo(worker_id=HOSTILE, model=HOSTILE, state="ready", capacity=2)
    model = pb.Model(model=HOSTILE, image=HOSTILE, replicas=1)
    body = pages.fleet(
        [node],
        {HOSTILE: [worker]},
        {},
        {HOSTILE: {HOSTILE: 2e9}},
        {HOSTILE: 2e9},
        [model],
        HOSTILE,
        now=1e9,
    )
    text = pages.layout(HOSTILE, body, actions_on=True)
    parser = Tags()
    parser.feed(text)
    tags = {tag for tag, _ in parser.tags}
    assert "img" not in tags
    assert [a["src"] for tag, a in parser.tags if tag == "script"] == ["/static/dashboard.js"]
    assert not [k for _, a in parser.tags for k in a if k.startswith("on")]
    assert "<script>alert(1)</script>" not in text


def test_the_fleet_page_shows_each_nodes_work_managers():
    """A Slurm node is shown with its cluster and Slurm node name beside Docker; a node whose
    agent sent no managers (registered before they were sent) shows a dash."""
    slurm = pb.Node(
        node_id="node-a",
        managers=[
            pb.WorkManager(name="docker"),
            pb.WorkManager(name="slurm", node_name="gpu-017", cluster="west"),
        ],
    )
    body = pages.fleet([slurm, pb.Node(node_id="node-b")], {}, {}, {}, {}, [], None, now=1e9)
    assert "<th>managers</th>" in body
    assert '<td class="managers">docker,slurm:west/gpu-017</td>' in body
    assert body.count('<td class="managers">-</td>') == 1


def test_the_fleet_page_shows_each_nodes_cloud_instance():
    """An AWS spot node shows where it is and what it is, its instance id on hover; a node that
    never reported one shows a dash."""
    aws = pb.Node(
        node_id="node-a",
        cloud=pb.CloudIdentity(
            provider="aws",
            instance_id="i-0123456789abcdef0",
            region="us-east-1",
            zone="us-east-1a",
            instance_type="g5.xlarge",
            spot=True,
        ),
    )
    body = pages.fleet([aws, pb.Node(node_id="node-b")], {}, {}, {}, {}, [], None, now=1e9)
    assert "<th>cloud</th>" in body
    assert (
        '<td class="cloud" title="i-0123456789abcdef0">aws/us-east-1a/g5.xlarge/spot</td>' in body
    )
    assert body.count('<td class="cloud" title="">-</td>') == 1


def test_the_reclamation_list_escapes_ids_and_links_them_quoted():
    rec = {
        "reclaim_id": HOSTILE,
        "node_id": HOSTILE,
        "reason": HOSTILE,
        "t0": 0.0,
        "outcome": "drained",
        "spare_s": 1.5,
    }
    text = pages.reclamations([rec], None)
    assert "<script>" not in text
    assert 'href="/reclamations/%22%3E%3Cscript%3E' in text
    assert "drained, 1.500 s spare" in text


def test_loopback_names_and_addresses():
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "10.0.0.1", "example.com", "::", ""]))


def test_a_dashboard_off_loopback_needs_dashboard_public(tmp_path):
    """The fleet is readable without a credential: binding elsewhere is refused at start,
    with the reason, before the store is touched."""
    argv = [
        str(BIN / "spotdrain-coordinator"),
        "--listen",
        "127.0.0.1:0",
        "--insecure",
        "--db",
        str(tmp_path / "c.sqlite"),
        "--dashboard-listen",
        "0.0.0.0:0",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "not a loopback address" in out.stderr and "--dashboard-public" in out.stderr
    assert not (tmp_path / "c.sqlite").exists()
    token = tmp_path / "token"
    token.write_text("short")
    token.chmod(0o600)
    out = subprocess.run(
        [*argv[:-1], "127.0.0.1:0", "--dashboard-token-file", str(token)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "at least 16 characters" in out.stderr
