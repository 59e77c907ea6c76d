"""spotctl's command line: every verb, its arguments and their bounds, checked before a call
is made."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from spotdrain.protocol import kinds
from spotdrain.runtime.cli import ArgumentParser

PROG = "spotctl"
ENDED_BY = ("renter", "provider", "platform")
# Replicas: a leader's failover is its lease's TTL and a renewal (about 2.5 s by default) and a
# rebuild; the wait is that with room to spare.
LEADER_WAIT_S = 10.0


def count(text: str) -> int:
    """A whole number >= 0 (replicas, GPUs, slots: uint32 on the wire)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


def _json_flag(p: argparse.ArgumentParser, default: Any = False) -> None:
    p.add_argument("--json", action="store_true", default=default, help="JSON lines")


def parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="spotdrain operator CLI")
    p.add_argument("--coordinator", help="coordinator HOST:PORT, or replicas' A:PORT,B:PORT")
    p.add_argument(
        "--leader-wait-s",
        type=float,
        default=LEADER_WAIT_S,
        help=f"replicas: how long to wait for a leader (default {LEADER_WAIT_S:g})",
    )
    p.add_argument("--insecure", action="store_true", help="plaintext gRPC")
    p.add_argument("--tls-cert", help="operator certificate (CN operator:<name>)")
    p.add_argument("--tls-key")
    p.add_argument("--ca", help="CA of the coordinator's certificate")
    p.add_argument(
        "--socket",
        type=Path,
        default=Path("/run/spotdrain/agent.sock"),
        help="the agent's unix socket (pause, resume, status)",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    for name, text in (
        ("pause", "take the machine back: drain it, free by the deadline"),
        ("resume", "make the machine available again"),
        ("status", "this node's state, workers and drain in progress"),
    ):
        local = sub.add_parser(name, help=text)
        local.add_argument("--json", action="store_true")
    wk = sub.add_parser("workers", help="inference workers")
    wsub = wk.add_subparsers(dest="workers_command", required=True, parser_class=ArgumentParser)
    ws = wsub.add_parser("start", help="place a worker on a node, through the placement gate")
    ws.add_argument("node")
    ws.add_argument("--model", required=True)
    ws.add_argument("--image", required=True)
    ws.add_argument("--slots", type=int, default=4)
    ws.add_argument("--port", type=int, default=0, help="worker port (default: picked)")
    ws.add_argument("--kind", choices=kinds.WORKERS, default="inference")
    ws.add_argument("--json", action="store_true")
    wl = wsub.add_parser("list", help="workers and their state")
    wl.add_argument("--node", default="")
    wl.add_argument("--json", action="store_true")
    ev = sub.add_parser("events", help="lifecycle events, one JSON object a line")
    ev.add_argument("--json", action="store_true", help="JSON lines (the only format)")
    ev.add_argument("--from", dest="from_id", type=int, default=0, help="after this event id")
    ev.add_argument("--follow", action="store_true", help="keep printing new events")
    tl = sub.add_parser("timeline", help="a reclamation as a table of steps")
    tl.add_argument("reclaim_id", nargs="?", default="", help="default: the latest")
    tl.add_argument("--json", action="store_true")
    tl.add_argument(
        "--svg", metavar="FILE", default="", help="also write it as an SVG sequence diagram"
    )
    _json_flag(sub.add_parser("nodes", help="nodes: flags, taints, workers, rentals"))
    nd = sub.add_parser("node", help="change a node's flags")
    nsub = nd.add_subparsers(dest="node_command", required=True, parser_class=ArgumentParser)
    spot = nsub.add_parser("set-spot", help="spot (true) or on-demand (false)")
    spot.add_argument("node")
    spot.add_argument("spot", choices=("true", "false"))
    _json_flag(spot)
    add_rentals(sub)
    rp = sub.add_parser("reputation", help="a node's or a provider's reputation")
    subject = rp.add_mutually_exclusive_group(required=True)
    subject.add_argument("node", nargs="?", help="node id")
    subject.add_argument("--provider")
    _json_flag(rp)
    md = sub.add_parser("models", help="desired capacity: workers kept placed per model")
    msub = md.add_subparsers(dest="models_command", required=True, parser_class=ArgumentParser)
    _json_flag(msub.add_parser("list", help="models, desired and actual workers"))
    mr = msub.add_parser("set-replicas", help="how many workers of a model to keep placed")
    mr.add_argument("model")
    mr.add_argument("replicas", type=count)
    mr.add_argument("--image", default="", help="needed the first time a model is set")
    mr.add_argument("--slots", type=count, default=0, help="per worker (default: 4)")
    _json_flag(mr)
    _json_flag(
        sub.add_parser(
            "workloads", help="workload images: how their reclamations ended, which are flagged"
        )
    )
    return p


def add_rentals(sub: Any) -> None:
    rt = sub.add_parser("rentals", help="rentals: list (the default), create, get, end, watch")
    # `rentals --active` lists too. The list flags live on both parsers; the sub-command's copies
    # default to SUPPRESS so they never overwrite what was given before the sub-command's name.
    rt.add_argument("--node", default="", help="only this node's")
    rt.add_argument("--active", action="store_true", help="only rentals not ended")
    _json_flag(rt)
    rsub = rt.add_subparsers(dest="rentals_command", parser_class=ArgumentParser)
    ls = rsub.add_parser("list", help="rentals, newest state")
    ls.add_argument("--node", default=argparse.SUPPRESS, help="only this node's")
    ls.add_argument("--active", action="store_true", default=argparse.SUPPRESS)
    _json_flag(ls, argparse.SUPPRESS)
    cr = rsub.add_parser("create", help="rent GPUs on a node, through the placement gate")
    cr.add_argument("node_id", metavar="NODE")
    cr.add_argument("--image", required=True)
    cr.add_argument("--gpus", type=count, default=1)
    cr.add_argument("--renter", default="", help="the renter's name (an operator's call)")
    _json_flag(cr, argparse.SUPPRESS)
    for name, text in (
        ("get", "one rental"),
        ("watch", "one rental, then every change until it has ended"),
        ("end", "end a rental: its container is stopped"),
    ):
        one = rsub.add_parser(name, help=text)
        one.add_argument("rental_id")
        _json_flag(one, argparse.SUPPRESS)
        if name == "end":
            one.add_argument("--ended-by", choices=ENDED_BY, default="", help="default: platform")
