"""Notice sources: one module per provider, each turning what it reads into a `Notice`, a
`NoticeInvalid` or an `Advisory` for the agent's source hub (agent/notices/hub.py).

Each module has a `Config` (with `from_table`, which checks that source's keys in agent.toml)
and a `Source` (`name`, `health`, `async run()`). Adding a source is one module and one line in
MODULES; it touches no other source.
"""

from __future__ import annotations

import importlib
from types import ModuleType

MODULES = {
    "file": "spotdrain.agent.notices.file",
    "aws": "spotdrain.agent.notices.aws",
    "gcp": "spotdrain.agent.notices.gcp",
    "azure": "spotdrain.agent.notices.azure",
    "shutdown": "spotdrain.agent.notices.shutdown",
}


def module(name: str) -> ModuleType:
    return importlib.import_module(MODULES[name])
