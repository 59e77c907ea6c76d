"""The soak's batch workloads, and what each one saw from inside its container.

One busybox script, three behaviours (`SPOTDRAIN_SOAK_BEHAVIOUR`):

  exits        on SIGTERM, exits 0 at once.
  checkpoints  on SIGTERM, "checkpoints" for $CHECKPOINT_S seconds, copies the deadline file
               as it sees it meanwhile, then exits 0; a further SIGTERM does not restart it.
  ignores      carries on after SIGTERM; only SIGKILL ends it (exit code 137).

Whatever the behaviour, the trap first appends `TERM <uptime>` to /soak/events, a file on a
bind mount that outlives the container: the number of SIGTERMs the process really received,
and when (CLOCK_BOOTTIME, /proc/uptime, converted to wall time by the host). The script runs as
PID 1, which the kernel gives no signal it has no handler for, so TERM is trapped explicitly.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import docker
import docker.errors
import docker.types

from fakes.dockerenv import BASE_IMAGE

BEHAVIOURS = ("exits", "checkpoints", "ignores")
HONOURS_SIGTERM = frozenset({"exits", "checkpoints"})
CONTAINER_DIR = "/soak"
DEADLINE_DIR = "/spotdrain"
EVENTS_FILE = "events"
DEADLINE_COPY = "deadline.json"

# `now` sets $cs to the boot clock in centiseconds: /proc/uptime always has two decimals, and
# past the first second of uptime the digits never start with a 0 (no octal surprise).
SCRIPT = r"""
now() { read up rest < /proc/uptime; cs="${up%.*}${up#*.}"; }
stamp() { read up rest < /proc/uptime; echo "$1 $up" >> /soak/events; }
checkpoint() {
  now; end=$((cs + CHECKPOINT_CS))
  while [ "$cs" -lt "$end" ]; do
    f="$SPOTDRAIN_DEADLINE_FILE"
    if [ -z "$seen" ] && [ -s "$f" ]; then cat "$f" > /soak/deadline.json; seen=1; fi
    sleep 0.05
    now
  done
}
on_term() {
  stamp TERM
  case "$SPOTDRAIN_SOAK_BEHAVIOUR" in
    exits) stamp EXIT; exit 0 ;;
    ignores) kill $! 2>/dev/null ;;
    checkpoints)
      if [ -n "$checkpointing" ]; then return; fi
      checkpointing=1
      checkpoint
      stamp EXIT
      exit 0 ;;
  esac
}
trap on_term TERM
stamp READY
while :; do sleep 3600 & wait $!; done
"""


def boot_clock_offset() -> float:
    """Wall time minus the boot clock, to turn the workloads' /proc/uptime stamps into wall
    time (both clocks tick together; the 10 ms resolution of /proc/uptime is the error)."""
    up = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - up


@dataclass
class Workload:
    """One container of one round: how it behaves, and (once the round is over) what it saw."""

    name: str
    behaviour: str
    checkpoint_s: float
    host_dir: Path
    container_id: str = ""
    # What the workload saw, in wall time: each SIGTERM, and its own exit (exits, checkpoints).
    sigterms: list[float] = field(default_factory=list)
    exited_by_itself_at: float | None = None
    deadline_seen: dict | None = None  # the deadline file as the workload read it
    # What the engine says once it has stopped.
    exit_code: int | None = None
    finished_at: float | None = None
    killed_by_soak: bool = False  # a lifted reclamation left it running; the soak removed it

    @property
    def honours_sigterm(self) -> bool:
        return self.behaviour in HONOURS_SIGTERM

    def start(self, client: docker.DockerClient, node_id: str, deadline_file: Path) -> None:
        self.host_dir.mkdir(parents=True, exist_ok=True)
        (self.host_dir / EVENTS_FILE).touch()
        deadline_file.parent.mkdir(parents=True, exist_ok=True)  # the agent writes it later
        container = client.containers.run(
            BASE_IMAGE,
            ["sh", "-c", SCRIPT],
            name=self.name,
            labels={
                "spotdrain.node": node_id,
                "spotdrain.kind": "batch",
                "spotdrain.test.behaviour": self.behaviour,
            },
            environment={
                "SPOTDRAIN_SOAK_BEHAVIOUR": self.behaviour,
                "CHECKPOINT_CS": str(round(self.checkpoint_s * 100)),
                "SPOTDRAIN_DEADLINE_FILE": f"{DEADLINE_DIR}/{deadline_file.name}",
            },
            mounts=[
                docker.types.Mount(CONTAINER_DIR, str(self.host_dir), type="bind"),
                docker.types.Mount(
                    DEADLINE_DIR, str(deadline_file.parent), type="bind", read_only=True
                ),
            ],
            network_mode="none",
            detach=True,
        )
        self.container_id = container.id

    def lines(self) -> list[tuple[str, float]]:
        out = []
        for line in (self.host_dir / EVENTS_FILE).read_text().splitlines():
            what, _, up = line.partition(" ")
            try:
                out.append((what, float(up)))
            except ValueError:
                continue  # a line cut by SIGKILL mid-write
        return out

    def ready(self) -> bool:
        return any(what == "READY" for what, _ in self.lines())

    def collect(self, client: docker.DockerClient, offset: float) -> None:
        """Read what the workload and the engine saw; the container must have stopped."""
        for what, up in self.lines():
            if what == "TERM":
                self.sigterms.append(up + offset)
            elif what == "EXIT":
                self.exited_by_itself_at = up + offset
        copy = self.host_dir / DEADLINE_COPY
        if copy.exists():
            try:
                self.deadline_seen = json.loads(copy.read_text())
            except ValueError:
                self.deadline_seen = {"unreadable": copy.read_text()[:200]}
        state = client.api.inspect_container(self.container_id)["State"]
        self.exit_code = state["ExitCode"]
        self.finished_at = _engine_time(state["FinishedAt"])


def _engine_time(text: str) -> float | None:
    """Docker's RFC 3339 time with nanoseconds, as epoch seconds."""
    if not text or text.startswith("0001-"):
        return None
    head, _, frac = text.rstrip("Z").partition(".")
    base = datetime.fromisoformat(head + "+00:00").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def running(client: docker.DockerClient, container_id: str) -> bool:
    try:
        return client.api.inspect_container(container_id)["State"]["Running"]
    except docker.errors.NotFound:
        return False
