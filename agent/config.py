"""The agent's settings: every flag has a key in the TOML file; flags win over the file.

A bad flag or file gives one clear line and exit code 2 (spotdrain.runtime.cli.UsageError).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotdrain.agent.core.reclamation import Margins
from spotdrain.agent.notices import module as source_module
from spotdrain.agent.notices.settings import (
    AdvisoryPolicy,
    SourcesConfig,
    parse_advisory,
    parse_sources,
)
from spotdrain.agent.workloads.settings import WorkloadSettings, parse_workloads
from spotdrain.protocol import timing
from spotdrain.runtime.cli import ArgumentParser, UsageError, host_port
from spotdrain.workload import DEFAULT_DEADLINE_FILE

PROG = "spotdrain-agent"


@dataclass(frozen=True)
class AgentConfig:
    coordinator: str  # HOST:PORT, or several comma-separated (replicas: the leader is found)
    node_id: str
    # A packaged daemon's paths: what systemd's RuntimeDirectory/StateDirectory and Debian's
    # docker.io give, so an install needs only the coordinator, the node id and TLS files.
    notice_file: Path = Path("/run/spotdrain/notice.json")
    state_dir: Path = Path("/var/lib/spotdrain")
    docker_host: str = "unix:///run/docker.sock"
    insecure: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    ca: str = ""
    node_group: str = "default"
    spot: bool = True
    # Who owns this node: the provider its rentals count for in reputation (empty: the
    # coordinator uses the node id).
    provider: str = ""
    # Workloads read this (bind-mounted read-only; path in SPOTDRAIN_DEADLINE_FILE).
    # In a directory of its own: workloads bind-mount the directory, since a file mount would
    # keep showing the old inode after an atomic replace.
    deadline_file: Path = DEFAULT_DEADLINE_FILE
    # Each workload container's own status directory, <status_dir>/<container name>,
    # bind-mounted read-write at SPOTDRAIN_STATUS_DIR, for its reports
    # (agent/workloads/status_dirs.py).
    status_dir: Path = Path("/run/spotdrain/status")
    margins: Margins = field(default_factory=Margins)
    docker_call_timeout_s: float = 2.0  # each kill/list call; then signal the PID ourselves
    nvml_timeout_s: float = 2.0  # an NVML call that takes longer is an error, not "empty"
    notice_poll_s: float = 5.0  # fallback poll when inotify cannot watch the notice file
    inventory_every_s: float = 5.0  # container PIDs kept fresh for the hung-engine fallback
    log_level: str = "INFO"
    # The owner's switch: spotctl pause/resume/status over this unix socket (mode 0660,
    # root and this group; callers are checked with SO_PEERCRED).
    socket: Path = Path("/run/spotdrain/agent.sock")
    socket_group: str = "spotdrain"
    pause_notice_s: float = timing.NOTICE_S  # the owner's promise: D = pause + this
    # Slot gates: where they listen, the host routers reach them at, and the gate port of a
    # worker (its port + this offset).
    gate_host: str = "0.0.0.0"
    advertise_host: str = "127.0.0.1"
    gate_port_offset: float = 1000
    # Prometheus metrics (HOST:PORT; empty: off).
    metrics_listen: str = ""
    # Notice sources ([sources] in the file) and what an advisory does ([advisory]).
    sources: SourcesConfig = field(default_factory=SourcesConfig)
    advisory: AdvisoryPolicy = field(default_factory=AdvisoryPolicy)
    # Each source to run, its settings checked at start: name -> that source's Config.
    source_configs: dict[str, Any] = field(default_factory=dict)
    # The work managers drained ([workloads]): Docker, Slurm, or both.
    workloads: WorkloadSettings = field(default_factory=WorkloadSettings)

    @property
    def coordinators(self) -> tuple[str, ...]:
        """Every coordinator replica's address, in the order given."""
        return tuple(a.strip() for a in self.coordinator.split(",") if a.strip())


# flag name -> (config key, type, help). Margins live under [margins] in the file.
SETTINGS: dict[str, tuple[type, str]] = {
    "coordinator": (str, "coordinator HOST:PORT, or replicas' A:PORT,B:PORT (a list in TOML)"),
    "node_id": (str, "this node's id (must match its certificate)"),
    "notice_file": (Path, "the provider's notice file to watch"),
    "state_dir": (Path, "where bundles and the outbox live"),
    "docker_host": (str, "Docker Engine API, unix:///PATH"),
    "tls_cert": (str, "this node's certificate (CN node:<node-id>)"),
    "tls_key": (str, "its key"),
    "ca": (str, "the CA that signed the coordinator's certificate"),
    "node_group": (str, "node group (capacity pool) of this node"),
    "provider": (str, "who owns this node, for rental reputation (default: the node id)"),
    "deadline_file": (Path, "deadline file that workloads read"),
    "status_dir": (Path, "root of the workloads' status directories (one per container)"),
    "docker_call_timeout_s": (float, "per-call Docker API timeout"),
    "nvml_timeout_s": (float, "per-call NVML timeout"),
    "notice_poll_s": (float, "fallback poll interval for the notice file"),
    "inventory_every_s": (float, "how often container PIDs are refreshed"),
    "log_level": (str, "DEBUG, INFO, WARNING"),
    "socket": (Path, "the owner's unix socket (spotctl pause/resume/status)"),
    "socket_group": (str, "group allowed on the socket besides root"),
    "pause_notice_s": (float, "seconds from a pause to D"),
    "gate_host": (str, "address the slot gates listen on"),
    "advertise_host": (str, "host routers use to reach this node's gates"),
    "gate_port_offset": (float, "a worker's gate port = its port + this"),
    "metrics_listen": (str, "serve Prometheus /metrics on HOST:PORT"),
}
MARGINS = {f.name: float for f in dataclasses.fields(Margins)}
REQUIRED = ("coordinator", "node_id")


def parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="spotdrain agent: answers reclaim notices")
    p.add_argument("--config", type=Path, help="TOML file; flags override it")
    for name, (_, help_text) in SETTINGS.items():
        p.add_argument("--" + name.replace("_", "-"), help=help_text, default=None)
    p.add_argument("--insecure", action="store_true", default=None, help="plaintext gRPC")
    p.add_argument("--spot", choices=["true", "false"], default=None, help="spot or on-demand")
    for name in MARGINS:
        p.add_argument("--" + name.replace("_", "-"), default=None, help=f"margins.{name}")
    p.add_argument(
        "--sources",
        default=None,
        help="run exactly these notice sources, comma-separated (file,aws,gcp,azure,shutdown); "
        "turns [sources] auto off",
    )
    p.add_argument("--dmi-dir", default=None, help="sources.dmi_dir: where auto reads DMI")
    return p


def load(argv: list[str] | None = None) -> AgentConfig:
    args = parser().parse_args(argv)
    doc: dict[str, Any] = {}
    if args.config is not None:
        try:
            doc = tomllib.loads(args.config.read_text())
        except OSError as e:
            raise UsageError(f"cannot read config {args.config}: {e.strerror}") from e
        except UnicodeDecodeError as e:
            raise UsageError(f"config {args.config}: not UTF-8 at byte {e.start}") from e
        except tomllib.TOMLDecodeError as e:
            raise UsageError(f"config {args.config}: {e}") from e
    return from_sources(vars(args), doc, str(args.config or ""))


def from_sources(flags: dict[str, Any], doc: dict[str, Any], origin: str = "") -> AgentConfig:
    where = f"config {origin}: " if origin else "config: "
    margins_doc = doc.pop("margins", {})
    if not isinstance(margins_doc, dict):
        raise UsageError(f"{where}[margins] must be a table")
    sources_doc = doc.pop("sources", None)
    if flags.get("dmi_dir") is not None:
        sources_doc = {
            **(sources_doc if isinstance(sources_doc, dict) else {}),
            "dmi_dir": flags["dmi_dir"],
        }
    sources = parse_sources(sources_doc, where, flags.get("sources"))
    advisory = parse_advisory(doc.pop("advisory", None), where)
    workloads = parse_workloads(doc.pop("workloads", None), where)
    known = set(SETTINGS) | {"insecure", "spot"}
    unknown = sorted(set(doc) - known) + [
        f"margins.{k}" for k in sorted(set(margins_doc) - set(MARGINS))
    ]
    if unknown:
        raise UsageError(f"{where}unknown setting {unknown[0]}")

    values: dict[str, Any] = {}
    for name, (kind, _) in SETTINGS.items():
        raw = flags.get(name)
        source = f"--{name.replace('_', '-')}"
        if raw is None and name in doc:
            raw, source = doc[name], f"{where}{name}"
        if name == "coordinator" and isinstance(raw, list):  # replicas: ["a:7443", "b:7443"]
            raw = ",".join(_convert(a, str, source) for a in raw)
        if raw is not None:
            values[name] = _convert(raw, kind, source)
    for name in ("insecure", "spot"):
        raw = flags.get(name)
        if raw is None and name in doc:
            raw = doc[name]
            if not isinstance(raw, bool):
                raise UsageError(f"{where}{name} must be true or false")
        if raw is not None:
            values[name] = raw if isinstance(raw, bool) else raw == "true"
    margins: dict[str, float] = {}
    for name in MARGINS:
        raw = flags.get(name)
        source = f"--{name.replace('_', '-')}"
        if raw is None and name in margins_doc:
            raw, source = margins_doc[name], f"{where}margins.{name}"
        if raw is not None:
            margins[name] = _convert(raw, float, source)

    missing = [n for n in REQUIRED if n not in values]
    if missing:
        raise UsageError(
            f"missing --{missing[0].replace('_', '-')} (or {missing[0]} in the config)"
        )
    addresses = [a.strip() for a in str(values["coordinator"]).split(",")]
    for address in addresses:
        host_port(address, "--coordinator")
    if values.get("metrics_listen"):
        host_port(values["metrics_listen"], "--metrics-listen")
    docker_host = str(values.get("docker_host", AgentConfig.docker_host))
    if not docker_host.startswith("unix://"):
        raise UsageError(f"--docker-host must be unix:///PATH, got {docker_host!r}")
    tls = [values.get(k, "") for k in ("tls_cert", "tls_key", "ca")]
    if values.get("insecure") and any(tls):
        raise UsageError("--insecure and TLS flags exclude each other")
    if not values.get("insecure") and not all(tls):
        raise UsageError("give --tls-cert, --tls-key and --ca, or --insecure")
    for name in (
        "docker_call_timeout_s",
        "nvml_timeout_s",
        "notice_poll_s",
        "inventory_every_s",
        "pause_notice_s",
    ):
        if name in values and values[name] <= 0:
            raise UsageError(f"{name} must be positive")
    level = str(values.get("log_level", "INFO")).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise UsageError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {level!r}")
    try:
        values["margins"] = Margins(**margins)
    except ValueError as e:
        raise UsageError(str(e)) from e
    values["sources"] = sources
    values["advisory"] = advisory
    values["workloads"] = workloads
    values["source_configs"] = source_configs(sources, values, flags, where)
    return AgentConfig(**values)


def source_configs(
    sources: SourcesConfig, values: dict[str, Any], flags: dict[str, Any], where: str
) -> dict[str, Any]:
    """Each source that will run, its table checked now: a bad endpoint is exit 2 at start,
    not a source that fails later. The file source's path is --notice-file when given (it
    always was), else sources.file.path, else notice_file."""
    out = {}
    for name in sources.names():
        table = dict(sources.tables.get(name, {}))
        if name == "file":
            if flags.get("notice_file") is not None or "path" not in table:
                table["path"] = str(values.get("notice_file", AgentConfig.notice_file))
            table.setdefault("poll_s", values.get("notice_poll_s", AgentConfig.notice_poll_s))
        out[name] = source_module(name).Config.from_table(table, where)
    return out


def _convert(raw: Any, kind: type, source: str) -> Any:
    if kind is float:
        if isinstance(raw, bool):
            raise UsageError(f"{source} must be a number, got {raw!r}")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise UsageError(f"{source} must be a number, got {raw!r}") from None
        if not math.isfinite(value):  # nan would never compare, inf never fire
            raise UsageError(f"{source} must be a finite number, got {raw!r}")
        return value
    if not isinstance(raw, str | Path):
        raise UsageError(f"{source} must be a string, got {raw!r}")
    value = kind(raw)
    if value == "" or value == Path(""):
        raise UsageError(f"{source} must not be empty")
    return value
