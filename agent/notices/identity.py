"""The node's cloud identity, read by its notice source from the same metadata service: provider,
instance id, region, zone, instance type, spot. The agent sends it when it registers.

It is read apart from the notices: its own HTTP session (a hanging GET or a poll never waits
behind it), each request bounded by the source's read timeout, and a failure only retried later
(IDENTITY_RETRY_S), never a source down. Values are checked as the coordinator checks them
(spotdrain.protocol.cloud): one it would refuse is a failed read, never sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Protocol

from spotdrain.agent.notices.metadata_http import ReadFailed
from spotdrain.protocol import cloud
from spotdrain.v1 import spotdrain_pb2 as pb

log = logging.getLogger("spotdrain.agent.notices")
# Seconds before each retry of a failed read, the last repeated: the metadata service of a VM
# still booting may take a while, and nothing waits for the answer.
IDENTITY_RETRY_S = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class CloudIdentity:
    provider: str
    instance_id: str
    region: str = ""
    zone: str = ""
    instance_type: str = ""
    spot: bool = False

    def __post_init__(self) -> None:
        why = cloud.problem(asdict(self))
        if why is not None:
            raise ReadFailed(f"{self.provider} identity: {why}")

    def to_pb(self) -> pb.CloudIdentity:
        return pb.CloudIdentity(**asdict(self))


class IdentitySink(Protocol):
    def identity(self, identity: CloudIdentity) -> None: ...


async def read_identity(
    source: str,
    read: Callable[[], Awaitable[CloudIdentity]],
    sink: IdentitySink,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Read until one read answers, then hand it to the sink once and return."""
    attempt = 0
    while True:
        try:
            found = await read()
        except ReadFailed as e:
            wait = IDENTITY_RETRY_S[min(attempt, len(IDENTITY_RETRY_S) - 1)]
            log.log(
                logging.INFO if attempt else logging.WARNING,
                "notice source %s: cloud identity not read (retry in %.0f s): %s",
                source,
                wait,
                e,
            )
            attempt += 1
            await sleep(wait)
            continue
        log.info("notice source %s: cloud identity %s", source, found)
        sink.identity(found)
        return


def last_segment(value: str) -> str:
    """Google's `projects/123/zones/us-central1-a` as `us-central1-a`."""
    return value.rsplit("/", 1)[-1]
