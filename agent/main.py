"""spotdrain-agent: the process. Reads the settings, sets up logging and runs the daemon
(agent/daemon.py) until the stop signal; a usage error exits 2 before anything starts."""

from __future__ import annotations

import asyncio
import logging
import sys

from spotdrain.agent import config as agent_config
from spotdrain.agent.config import AgentConfig
from spotdrain.agent.daemon import Agent
from spotdrain.net.security import warn_insecure
from spotdrain.runtime import systemd
from spotdrain.runtime.cli import UsageError, fail_usage

PROG = "spotdrain-agent"
log = logging.getLogger("spotdrain.agent")


async def amain(cfg: AgentConfig) -> int:
    agent = Agent(cfg)
    agent.supervisor.install_signal_handlers(on_stop=systemd.stopping)
    rc = await agent.run()
    if rc == 0:
        log.info("node %s: agent stopped; workloads left running", cfg.node_id)
    return rc


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = agent_config.load(argv)
    except UsageError as e:
        return fail_usage(PROG, str(e))
    systemd.configure_logging(PROG, cfg.log_level, node_id=cfg.node_id)
    if cfg.insecure:
        warn_insecure(PROG)
    try:
        return asyncio.run(amain(cfg))
    except (ValueError, UsageError) as e:  # unreadable TLS files, a Slurm node not known
        return fail_usage(PROG, str(e))


def entry() -> None:
    sys.exit(main())
