"""The node's deadline file, as the node core asks for it (agent/core/node.py decides which
reclamation it shows): written atomically for workloads to read, removed once no drain is in
force. A disk that refuses it stops nothing: the last one asked for is held and written again
by retry()."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from spotdrain.agent.core.reclamation_commands import WriteDeadlineFile
from spotdrain.agent.drain.state import WriteHealth, write_deadline_file

log = logging.getLogger("spotdrain.agent.drain")
Writer = Callable[[Path, str, float, float, str], None]


class DeadlineFile:
    def __init__(
        self, path: Path, health: WriteHealth, write: Writer = write_deadline_file
    ) -> None:
        self.path = path
        self.health = health
        self._write = write
        # The file as last asked for, while the disk refuses it (None: written, or removed).
        self.unwritten: WriteDeadlineFile | None = None

    def show(self, cmd: WriteDeadlineFile) -> bool:
        """Write the file; False (held for retry) when the disk refused it."""
        try:
            self._write(self.path, cmd.reclaim_id, cmd.terminate_at, cmd.grace_deadline, cmd.reason)
        except OSError as e:
            self.unwritten = cmd
            self.health.failed(self.path, e)
            return False
        except ValueError as e:  # a deadline the file's format refuses: never a crash (loop)
            log.error("reclamation %s: deadline file not written: %s", cmd.reclaim_id, e)
            self.unwritten = None
            return True
        self.unwritten = None
        self.health.wrote(self.path)
        return True

    def remove(self) -> None:
        self.unwritten = None
        try:
            self.path.unlink(missing_ok=True)
        except OSError as e:
            self.health.failed(self.path, e)

    def retry(self) -> bool:
        """Write the held file again. True when nothing is left to write."""
        return self.unwritten is None or self.show(self.unwritten)
