"""The soak's counts, each made from what was observed, never from what should have happened.

Sources: what each workload saw from inside its container (its SIGTERMs, its own exit, the
deadline file it read), what the engine says (exit code, FinishedAt, the signals its API
delivered), each agent's outbox ledger (every event it stored), the agent's bundle and deadline
file as the soak saw them while the reclamation ran, and the coordinator's stored events and
reclamation records. Every count comes with its findings: the reclamation, node, reclaim id and
what was seen, so a failure can be replayed with the same --seed.

Failures (each must be 0):
  overruns_honoured      an `overrun` where every workload honoured SIGTERM, or an honouring
                         workload that did not end by itself before O (killed at G, or gone
                         only after O)
  double_sigterms        SIGTERMs beyond the first one a container got (what it saw itself,
                         or what the engine delivered, whichever is more)
  events_lost            an event an agent stored that the coordinator lacks, or a fact with no
                         event: a SIGTERM seen without `sigterm_sent`, an exit without
                         `container_exited`, a SIGKILL'd workload without `sigkill_sent`, a
                         reclamation without `notice_received` or its outcome
  events_stored_twice    a uid stored twice, or a once-only fact stored twice (a second
                         `notice_received`, `drained`, a container's second `sigterm_sent`...)
  drained_unverified     a `drained` with no `verified_empty` stored before it, or stored while
                         one of the reclamation's workloads still ran (the engine's FinishedAt)
  deadlines_moved        a D, G or O (or T0) seen anywhere that is not the one the reclamation
                         began with, a SIGKILL before G, an `overrun` before O
  signalled_after_cancel a workload of a cancelled (lifted) reclamation that saw a SIGTERM
  crashes                a daemon that exited without being killed
  unsettled              a reclamation that did not settle within the soak's bound
Information: overruns_ignoring (an overrun with a workload that ignores SIGTERM: the work is lost
knowingly), the outcomes, the faults injected.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from .scenario import Round, Soak

FAILURES = (
    "overruns_honoured",
    "double_sigterms",
    "events_lost",
    "events_stored_twice",
    "drained_unverified",
    "deadlines_moved",
    "signalled_after_cancel",
    "crashes",
    "unsettled",
)
# Facts a reclamation records once, and those recorded once per container.
ONCE = (
    "notice_received",
    "deadline_file_written",
    "verified_empty",
    "drained",
    "overrun",
    "pause_resumed",
)
ONCE_PER_CONTAINER = ("sigterm_sent", "container_exited")
SIGTERM_NUMBER = 15
TIME_EPSILON_S = 1e-6  # deadlines travel as JSON doubles: equal, up to float subtraction


@dataclass
class Counts:
    reclamations: int = 0
    completed: int = 0  # settled at the agent and recorded at the coordinator, same outcome
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURES, 0))
    info: dict[str, Any] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)

    def add(self, count: str, rnd: Round | None, text: str, n: int = 1) -> None:
        self.counts[count] += n
        where = f"#{rnd.plan.number} {rnd.node} {rnd.reclaim_id}: " if rnd is not None else ""
        self.findings.append(f"{count}: {where}{text}")

    @property
    def failed(self) -> bool:
        return any(self.counts.values()) or self.completed != self.reclamations

    def to_json(self) -> dict[str, Any]:
        return {
            "reclamations": self.reclamations,
            "completed": self.completed,
            **self.counts,
            "info": self.info,
            "findings": self.findings,
        }


def count(soak: Soak) -> Counts:
    out = Counts(reclamations=soak.config.reclamations)
    stored = [e for e in soak.events if not str(e["uid"]).startswith("coordinator-")]
    uids = Counter(e["uid"] for e in soak.events)
    for uid, n in uids.items():
        if n > 1:
            out.add("events_stored_twice", None, f"uid {uid} stored {n} times", n - 1)
    for node, ledger in soak.ledgers.items():
        for e in ledger:
            if e["uid"] not in uids:
                out.add(
                    "events_lost",
                    None,
                    f"{node} stored {e['kind']} {e['uid']} "
                    f"(reclamation {e['reclaim_id'] or '-'}); the coordinator never did",
                )
    by_rid: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in stored:
        if e["reclaim_id"]:
            by_rid[e["reclaim_id"]].append(e)
    outcomes: Counter[str] = Counter()
    honouring_rounds = 0
    for rnd in soak.rounds:
        events = sorted(by_rid.get(rnd.reclaim_id, []), key=lambda e: e["id"])
        _round(out, soak, rnd, events)
        outcomes[f"{rnd.plan.kind}:{rnd.agent_outcome or '-'}"] += 1
        if any(w.honours_sigterm for w in rnd.workloads) and not _lifted_early(rnd):
            honouring_rounds += 1
    out.counts["crashes"] = len(soak.crashes)
    for crash in soak.crashes:
        out.findings.append(f"crashes: {crash}")
    faults = Counter(f.kind for f in soak.faults)
    out.info.update(
        {
            "outcomes": dict(sorted(outcomes.items())),
            "faults": dict(sorted(faults.items())),
            "reclamations_hit_by_a_fault": sum(bool(r.faults) for r in soak.rounds),
            "workloads": dict(Counter(w.behaviour for r in soak.rounds for w in r.workloads)),
            "rounds_with_honouring_workloads": honouring_rounds,
            "overruns_honoured_pct": round(
                100 * out.counts["overruns_honoured"] / max(honouring_rounds, 1), 3
            ),
            "events_stored": len(soak.events),
            "wall_s": round(soak.wall_s, 1),
        }
    )
    out.info.setdefault("overruns_ignoring", 0)
    return out


def _lifted_early(rnd: Round) -> bool:
    """Cancelled, or resumed mid-drain: the machine went back before any outcome, so nothing
    was due by O."""
    return rnd.agent_outcome in ("cancelled", "resumed")


def _reference(soak: Soak, rnd: Round, events: list[dict[str, Any]]) -> dict[str, float] | None:
    """The deadlines the reclamation began with: D as the soak wrote it in the notice, or, for
    a pause, the first D the agent recorded (T0 + the pause notice)."""
    c = soak.config
    if rnd.written_terminate_at is not None:
        d = rnd.written_terminate_at
    else:
        first = next((e for e in events if e["kind"] == "notice_received"), None)
        if first is None:
            seen = [v for where, v in rnd.deadlines_seen if where == "bundle"]
            if not seen:
                return None
            d = seen[0]["terminate_at"]
        else:
            d = first["terminate_at"]
    return {"terminate_at": d, "grace_deadline": d - c.grace_s, "overrun_at": d - c.overrun_s}


def _same_time(a: Any, b: float, tolerance: float = TIME_EPSILON_S) -> bool:
    # Absolute only: a relative tolerance at epoch seconds (1.8e9) would hide whole seconds.
    return isinstance(a, int | float) and abs(a - b) <= tolerance


def _moved(ref: dict[str, float], seen: dict[str, Any]) -> list[str]:
    return [
        f"{k} {seen[k]!r} (began {ref[k]!r})"
        for k in ref
        if k in seen and not _same_time(seen[k], ref[k])
    ]


def _round(out: Counts, soak: Soak, rnd: Round, events: list[dict[str, Any]]) -> None:
    c = soak.config
    kinds = Counter(e["kind"] for e in events)
    lifted = _lifted_early(rnd)
    if rnd.unsettled:
        out.add("unsettled", rnd, rnd.unsettled)

    # --- recorded: the coordinator's story of it, and its outcome -------------------------
    timeline = soak.timelines.get(rnd.reclaim_id)
    recorded_outcome = timeline.reclamation.outcome if timeline is not None else ""
    if not kinds["notice_received"]:
        out.add("events_lost", rnd, "no notice_received at the coordinator")
    expected = {
        "drained": "drained",
        "overrun": "overrun",
        "cancelled": "cancelled",
        "resumed": "",
    }.get(rnd.agent_outcome)
    ending = {
        "drained": "drained",
        "overrun": "overrun",
        "cancelled": "notice_cancelled",
        "resumed": "pause_resumed",
    }.get(rnd.agent_outcome)
    if ending is not None and not kinds[ending]:
        out.add("events_lost", rnd, f"the agent's outcome {rnd.agent_outcome} has no {ending}")
    if rnd.plan.kind == "pause" and not kinds["pause_resumed"]:
        out.add("events_lost", rnd, "the pause was resumed; no pause_resumed")
    if rnd.plan.kind == "cancel" and rnd.cancel_written_at and not kinds["notice_cancelled"]:
        out.add("events_lost", rnd, "the cancel was written; no notice_cancelled")
    if rnd.agent_outcome == "drained" and not kinds["verified_empty"]:
        out.add("events_lost", rnd, "drained; no verified_empty")
    if (
        not rnd.unsettled
        and ending is not None
        and recorded_outcome == expected
        and kinds["notice_received"]
    ):
        out.completed += 1

    # --- stored twice ----------------------------------------------------------------------
    for kind in ONCE:
        if kinds[kind] > 1:
            out.add(
                "events_stored_twice", rnd, f"{kind} stored {kinds[kind]} times", kinds[kind] - 1
            )
    if kinds["notice_cancelled"] > 1:
        out.add(
            "events_stored_twice",
            rnd,
            f"notice_cancelled stored {kinds['notice_cancelled']} times (one cancel)",
            kinds["notice_cancelled"] - 1,
        )
    per_container = Counter(
        (e["kind"], e.get("container")) for e in events if e["kind"] in ONCE_PER_CONTAINER
    )
    for (kind, container), n in per_container.items():
        if n > 1:
            out.add("events_stored_twice", rnd, f"{kind} for {container} stored {n} times", n - 1)

    # --- per workload: signals, exits, their events -------------------------------------------
    ref = _reference(soak, rnd, events)
    by_container = defaultdict(list)
    for e in events:
        if e.get("container"):
            by_container[e["container"]].append(e["kind"])
    overrun_stored = kinds["overrun"] > 0
    missed: list[str] = []  # honouring workloads that did not end by themselves before O
    for w in rnd.workloads:
        got = len(w.sigterms)
        delivered = soak.engine_signals.count(w.container_id, SIGTERM_NUMBER)
        if max(got, delivered) > 1:
            out.add(
                "double_sigterms",
                rnd,
                f"{w.name} ({w.behaviour}) saw {got} SIGTERMs, the engine delivered {delivered}",
                max(got, delivered) - 1,
            )
        recorded = by_container.get(w.container_id, [])
        if (got or delivered) and "sigterm_sent" not in recorded:
            out.add("events_lost", rnd, f"{w.name} got SIGTERM; no sigterm_sent")
        if rnd.agent_outcome == "cancelled" and got:
            out.add("signalled_after_cancel", rnd, f"{w.name} saw SIGTERM in a lifted cancel")
        agent_stopped = not w.killed_by_soak and (
            "sigterm_sent" in recorded or got or "sigkill_sent" in recorded
        )
        if agent_stopped and "container_exited" not in recorded:
            out.add("events_lost", rnd, f"{w.name} exited ({w.exit_code}); no container_exited")
        if not w.killed_by_soak and w.exit_code == 137 and "sigkill_sent" not in recorded:
            out.add("events_lost", rnd, f"{w.name} was SIGKILLed; no sigkill_sent")
        if (
            w.honours_sigterm
            and not lifted
            and not w.killed_by_soak
            and ref is not None
            and (
                w.exited_by_itself_at is None
                or w.exit_code != 0
                or (w.finished_at or math.inf) > ref["overrun_at"]
            )
        ):
            term = (
                f", its SIGTERM at G{_rel(w.sigterms[0], ref['grace_deadline'])}"
                if w.sigterms
                else ", no SIGTERM"
            )
            missed.append(
                f"{w.name} ({w.behaviour} {w.checkpoint_s} s) exit {w.exit_code} at "
                f"O{_rel(w.finished_at, ref['overrun_at'])}{term}"
            )
    if overrun_stored and all(w.honours_sigterm for w in rnd.workloads) and not missed:
        missed.append(f"overrun with only honouring workloads {[w.name for w in rnd.workloads]}")
    if missed:
        out.add("overruns_honoured", rnd, "; ".join(missed) + f"; faults {_faults(rnd)}")
    elif overrun_stored:
        out.info["overruns_ignoring"] = out.info.get("overruns_ignoring", 0) + 1
        out.findings.append(
            f"info: #{rnd.plan.number} {rnd.node} {rnd.reclaim_id}: overrun "
            f"with a workload that ignores SIGTERM; faults {_faults(rnd)}"
        )

    # --- drained only after an observation found the node empty --------------------------------
    for e in events:
        if e["kind"] != "drained":
            continue
        if not any(v["kind"] == "verified_empty" and v["id"] < e["id"] for v in events):
            out.add("drained_unverified", rnd, "drained with no verified_empty before it")
        still = [
            w.name for w in rnd.workloads if w.finished_at is None or w.finished_at > e["wall_time"]
        ]
        if still:
            out.add(
                "drained_unverified",
                rnd,
                f"drained at {e['wall_time']:.3f} while {still} still ran (engine FinishedAt)",
            )

    # --- deadlines ---------------------------------------------------------------------------
    if ref is None:
        return
    moved: list[str] = []
    t0s = {v["t0"] for where, v in rnd.deadlines_seen if where == "bundle"}
    if len(t0s) > 1:
        moved.append(f"bundle T0 took {len(t0s)} values {sorted(t0s)}")
    for where, seen in rnd.deadlines_seen:
        if where == "deadline file" and seen.get("reclaim_id") != rnd.reclaim_id:
            moved.append(f"the deadline file named {seen.get('reclaim_id')} while in force")
        moved += [f"{where}: {m}" for m in _moved(ref, seen)]
    for w in rnd.workloads:
        if w.deadline_seen is not None:
            seen = {
                "terminate_at": w.deadline_seen.get("terminate_at_epoch"),
                "grace_deadline": w.deadline_seen.get("grace_deadline_epoch"),
            }
            if w.deadline_seen.get("reclaim_id") != rnd.reclaim_id:
                other = w.deadline_seen.get("reclaim_id")
                moved.append(f"{w.name} read a deadline file of {other}")
            moved += [f"{w.name}'s deadline file: {m}" for m in _moved(ref, seen)]
    for e in events:
        if e["kind"] == "notice_received":
            moved += [f"notice_received: {m}" for m in _moved(ref, e)]
        elif e["kind"] == "drained" and isinstance(e.get("spare_s"), int | float):
            d = e["wall_time"] + e["spare_s"]
            if abs(d - ref["terminate_at"]) > 0.002:
                moved.append(f"drained's spare_s gives D {d:.3f} (began {ref['terminate_at']})")
        elif e["kind"] == "sigkill_sent" and e["wall_time"] < ref["grace_deadline"] - 1e-3:
            moved.append(f"sigkill_sent at G{_rel(e['wall_time'], ref['grace_deadline'])}")
        elif e["kind"] == "overrun" and e["wall_time"] < ref["overrun_at"] - 1e-3:
            moved.append(f"overrun at O{_rel(e['wall_time'], ref['overrun_at'])}")
    if timeline is not None:
        record = {k: getattr(timeline.reclamation, k) for k in ref}
        moved += [f"coordinator's record: {m}" for m in _moved(ref, record)]
    if rnd.plan.kind == "pause" and t0s:
        t0 = min(t0s)
        if not _same_time(ref["terminate_at"] - t0, c.pause_notice_s, 1e-3):
            moved.append(
                f"pause D is T0 + {ref['terminate_at'] - t0:.3f} s, not {c.pause_notice_s}"
            )
    if moved:
        out.add("deadlines_moved", rnd, "; ".join(moved))


def _rel(t: float | None, mark: float) -> str:
    if t is None:
        return " (never)"
    return f"{t - mark:+.3f} s"


def _faults(rnd: Round) -> str:
    if not rnd.faults:
        return "none"
    return ", ".join(
        f"{f.kind} {f.target} at +{f.start - rnd.opened_at:.1f}s for {f.end - f.start:.1f}s"
        for f in rnd.faults
    )


def report(counts: Counts, seed: int) -> str:
    """What soak.py prints and test_soak.py shows on failure."""
    lines = [
        f"soak seed {seed}: {counts.completed} of {counts.reclamations} reclamations "
        "completed and recorded"
    ]
    width = max(len(k) for k in FAILURES)
    for k in FAILURES:
        lines.append(f"  {k:<{width}}  {counts.counts[k]}")
    i = counts.info
    lines.append(
        f"  overruns of honouring workloads: {counts.counts['overruns_honoured']} of "
        f"{i.get('rounds_with_honouring_workloads')} reclamations "
        f"({i.get('overruns_honoured_pct')} %; the published design budgets 0.5 %)"
    )
    lines.append(f"  overruns with a workload that ignores SIGTERM: {i.get('overruns_ignoring')}")
    for key in (
        "outcomes",
        "workloads",
        "faults",
        "reclamations_hit_by_a_fault",
        "events_stored",
        "wall_s",
    ):
        lines.append(f"  {key}: {i.get(key)}")
    for finding in counts.findings:
        lines.append(f"  - {finding}")
    return "\n".join(lines)
