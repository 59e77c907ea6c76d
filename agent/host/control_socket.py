"""The owner's switch: `spotctl pause | resume | status` over a unix socket on the host.

The socket is mode 0660, owned by root and the `spotdrain` group, and every caller is checked
again with SO_PEERCRED: root, or a user in that group (docs/design.md "Security"). One JSON request
a connection, one JSON answer. The agent never exposes Docker through it.
"""

from __future__ import annotations

import asyncio
import grp
import json
import logging
import os
import pwd
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("spotdrain.agent.socket")

MAX_REQUEST = 4096
Handler = Callable[[str], Awaitable[dict[str, Any]]]


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def allowed(uid: int, gid: int, group: str) -> bool:
    if uid == 0:
        return True
    try:
        group_gid = grp.getgrnam(group).gr_gid
    except KeyError:
        return False  # no such group on this host: root only
    if gid == group_gid:
        return True
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        return False
    return group_gid in os.getgrouplist(user, gid)


class ControlSocket:
    def __init__(self, path: Path, group: str, handle: Handler) -> None:
        self.path = path
        self.group = group
        self.handle = handle
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        try:
            gid = grp.getgrnam(self.group).gr_gid
        except KeyError:
            gid = 0
            log.warning("group %s does not exist: only root may use %s", self.group, self.path)
        os.chown(self.path, 0 if os.geteuid() == 0 else -1, gid if os.geteuid() == 0 else -1)
        os.chmod(self.path, 0o660)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sock = writer.get_extra_info("socket")
            pid, uid, gid = peer_credentials(sock)
            # The request is read before any answer, refusal included: a client still writing
            # to a socket already closed would see a broken pipe instead of the reason.
            try:
                line = await asyncio.wait_for(reader.readline(), 5)
                request = json.loads(line[:MAX_REQUEST] or b"{}")
                command = request.get("command") if isinstance(request, dict) else None
            except (TimeoutError, ValueError):
                command = None
            if not allowed(uid, gid, self.group):
                log.warning("refused %s request from uid %d (pid %d)", self.path, uid, pid)
                await self._answer(
                    writer,
                    {
                        "ok": False,
                        "error": f"uid {uid} is neither root nor in group {self.group}",
                    },
                )
                return
            if command not in ("pause", "resume", "status"):
                await self._answer(
                    writer,
                    {
                        "ok": False,
                        "error": f"command must be pause, resume or status, got {command!r}",
                    },
                )
                return
            log.info("%s from uid %d (pid %d)", command, uid, pid)
            await self._answer(writer, {"ok": True, **await self.handle(command)})
        except (ConnectionError, OSError) as e:
            log.info("control socket client went away: %s", e)
        finally:
            writer.close()

    @staticmethod
    async def _answer(writer: asyncio.StreamWriter, doc: dict[str, Any]) -> None:
        writer.write(json.dumps(doc, sort_keys=True).encode() + b"\n")
        await writer.drain()


async def request(path: Path, command: str, timeout: float = 10.0) -> dict[str, Any]:
    """The client side, for spotctl."""
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), timeout)
    try:
        writer.write(json.dumps({"command": command}).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
    finally:
        writer.close()
    if not line:
        raise ConnectionError(f"{path}: the agent closed the connection without answering")
    return json.loads(line)
