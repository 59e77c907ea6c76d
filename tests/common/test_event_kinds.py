"""`events.KINDS` is the one list of event kinds: every kind the agent or the coordinator emits,
and every kind a reader compares against, is in it. The product code is read, not run, so an
emit point no test reaches is checked too: a new kind, or a typo in one, fails here first."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from spotdrain import workload
from spotdrain.agent.core.reclamation_events import MANAGER_NOTES
from spotdrain.protocol import events
from spotdrain.timeline import svg

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = [ROOT / "agent", ROOT / "coordinator", ROOT / "proto" / "spotdrain"]

# The calls that make an event, and where their kind argument is when it is not `kind=`.
EMITTERS = {
    "Emit": 0,  # the reclamation's command (agent/core/reclamation_commands.py)
    "Record": 0,  # the advisory book's (agent/core/advisories.py)
    "WorkerEvent": 0,  # the worker machine's (coordinator/core/worker_machine.py)
    "record": 0,  # the coordinator's event log, the drain runner's own events
    "record_soon": 0,
    "_emit": 0,
    "_tell": 0,  # the agent's state-write health
    "make_event": 0,
    "event": 0,  # the outbox's Outbox.event (agent/drain/outbox.py)
    "NewEvent": 1,  # (uid, kind, ...)
    "EventRecord": 1,
}
# Sink.record(source, kind, details): a notice source's own events.
SINK_RECORD = 1
# Kinds computed from data the scan cannot read, with what they may be.
COMPUTED = {
    ("agent/core/reclamation_reports.py", "doc['report']"): set(workload.REPORT_KINDS),
    ("agent/core/reclamation.py", "kind"): set(MANAGER_NOTES),
}
# Relays: they pass on a kind an emit point above made (a queue, a match on a command), or one
# from the wire (an agent's event, which may be newer than this coordinator: stored as sent).
RELAYS = {
    ("agent/notices/hub.py", "kind"),  # the advisory book's Record commands
    ("agent/drain/executor.py", "emit.kind"),  # the reclamation's Emit commands
    ("coordinator/api/convert.py", "ev.kind"),  # an agent's batch
    ("coordinator/fleet/eventlog.py", "kind"),  # record_soon's queue
    ("coordinator/fleet/wiring.py", "kind"),  # the worker machine's WorkerEvent
}
# The modules that read events by kind (folding them into a reclamation, counting them): the
# kinds they compare against are checked too. Elsewhere `kind` is a workload's kind.
READERS = {
    "coordinator/core/timeline.py",
    "proto/spotdrain/runtime/metrics.py",
    "agent/drain/executor.py",
}


def product_files() -> Iterator[Path]:
    for root in PRODUCT:
        for path in sorted(root.rglob("*.py")):
            if "v1" not in path.relative_to(ROOT).parts:
                yield path


def strings(node: ast.AST) -> set[str]:
    return {
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


class Scan(ast.NodeVisitor):
    """Collects (line, kinds) for each emit point and each comparison with a kind, and the
    emit points whose kind it cannot resolve."""

    def __init__(self, rel: str, tree: ast.Module) -> None:
        self.rel = rel
        self.module = tree
        self.functions: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
        self.found: list[tuple[int, set[str]]] = []
        self.unresolved: list[tuple[int, str]] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:  # noqa: N802
        self.functions.append(node)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815

    def visit_Call(self, node: ast.Call) -> None:  # noqa: N802
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in EMITTERS:
            index = EMITTERS[name]
            if (
                name == "record"
                and isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Attribute)
                and func.value.attr == "sink"
            ):
                index = SINK_RECORD
            arg = next((k.value for k in node.keywords if k.arg == "kind"), None)
            if arg is None and len(node.args) > index:
                arg = node.args[index]
            if arg is not None:
                self.kind_of(node.lineno, arg)
        if name == "react":  # events.react({kind: reaction})
            for arg in node.args:
                if isinstance(arg, ast.Dict):
                    self.found.append((node.lineno, set().union(*map(strings, arg.keys))))
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:  # noqa: N802
        # `ev.kind == "drained"`, `kind in OUTCOME_KINDS`: a reader's kinds.
        sides = [node.left, *node.comparators]
        if self.rel in READERS and any(self.is_kind(s) for s in sides):
            for side in sides:
                if isinstance(side, ast.Constant | ast.Tuple | ast.Set | ast.List):
                    self.found.append((node.lineno, strings(side)))
                elif isinstance(side, ast.Name) and side.id != "kind":
                    self.found.append((node.lineno, self.assigned(side.id, self.module)))
        self.generic_visit(node)

    @staticmethod
    def is_kind(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "kind") or (
            isinstance(node, ast.Attribute) and node.attr == "kind"
        )

    def kind_of(self, line: int, arg: ast.expr) -> None:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            self.found.append((line, {arg.value}))
            return
        if isinstance(arg, ast.Name):
            function = self.functions[-1] if self.functions else None
            if function is not None and arg.id in {
                a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)
            }:
                return  # passed through: its callers are emit points of their own
            values = self.assigned(arg.id, function) or self.assigned(arg.id, self.module)
            if values:
                self.found.append((line, values))
                return
        source = ast.unparse(arg)
        computed = COMPUTED.get((self.rel, source))
        if computed is not None:
            self.found.append((line, computed))
        elif (self.rel, source) not in RELAYS:
            self.unresolved.append((line, source))

    @staticmethod
    def assigned(name: str, scope: ast.AST | None) -> set[str]:
        """The strings `name` may hold in `scope`: from `name = ...` and from
        `for ..., name in ((..., "kind"), ...)`."""
        values: set[str] = set()
        for node in ast.walk(scope) if scope is not None else ():
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets
            ):
                values |= strings(node.value)
            elif isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple | ast.List):
                target = node.target
                if isinstance(target, ast.Name) and target.id == name:
                    values |= strings(node.iter)
                elif isinstance(target, ast.Tuple):
                    at = [i for i, t in enumerate(target.elts) if getattr(t, "id", None) == name]
                    for item in node.iter.elts:
                        if at and isinstance(item, ast.Tuple):
                            values |= strings(item.elts[at[0]])
        return values


def scan() -> tuple[dict[str, set[str]], list[str]]:
    """Every kind the product code names, with where; and the emit points left unresolved."""
    kinds: dict[str, set[str]] = {}
    unresolved = []
    for path in product_files():
        rel = path.relative_to(ROOT).as_posix()
        visitor = Scan(rel, ast.parse(path.read_text(), str(path)))
        visitor.visit(visitor.module)
        for line, found in visitor.found:
            for kind in found:
                kinds.setdefault(kind, set()).add(f"{rel}:{line}")
        unresolved += [f"{rel}:{line}: {source}" for line, source in visitor.unresolved]
    return kinds, unresolved


def test_every_kind_the_code_emits_or_reads_is_in_the_one_list():
    """A new event kind is added to events.KINDS in the same change that emits it."""
    kinds, unresolved = scan()
    missing = {kind: sorted(where) for kind, where in kinds.items() if kind not in events.KINDS}
    assert missing == {}
    assert unresolved == [], "name what these kinds may be in COMPUTED"


def test_the_scan_sees_the_emit_points_of_both_daemons():
    """The scan itself works: the kinds of every emitter form are found (a scan that finds
    nothing would pass the test above)."""
    kinds, _ = scan()
    for kind in (
        "notice_received",  # Emit in the reclamation
        "advisory_received",  # Record in the advisory book
        "notice_acknowledged",  # a source's sink.record(source, kind, ...)
        "events_dropped",  # a module constant in the outbox
        "state_write_failed",  # the state's _tell
        "provider_change_refused",  # a loop over (field, kind) pairs
        "checkpoint_committed",  # a workload's report
        "worker_ready",  # the worker machine's WorkerEvent
        "replacement_result",  # record_soon
        "model_replicas_set",  # an operation's record (coordinator/api/operations.py)
    ):
        assert kind in kinds, kind


def test_nothing_in_the_list_is_left_unused():
    """The list holds only kinds something emits: a kind no code emits any more goes from it
    in the same change."""
    kinds, _ = scan()
    assert sorted(events.KINDS - set(kinds)) == []


def test_the_timeline_draws_only_known_kinds():
    assert set(svg._ARROWS) - events.KINDS == set()


def test_every_kind_is_documented():
    """docs/api.md "Lifecycle events" names every kind in the list."""
    text = (ROOT / "docs" / "api.md").read_text()
    section = text[text.index("## Lifecycle events") :]
    section = section[: section.index("\n## ")] if "\n## " in section else section
    assert sorted(k for k in events.KINDS if f"`{k}`" not in section) == []
