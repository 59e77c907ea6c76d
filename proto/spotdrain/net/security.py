"""TLS credentials and identities shared by the agent, the coordinator and spotctl.

A certificate's common name says who its holder is: `node:<node-id>` for agents,
`operator:<name>` for people and their scripts, `router:<name>` for routers, which may only
read routes and report continued streams (docs/design.md "Security"), `renter:<name>` for a
renter's tooling, which sees only its own rentals, and `provider:<name>` for a node owner's
tooling, which may end rentals on its own nodes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import grpc

NODE = "node"
OPERATOR = "operator"
ROUTER = "router"
RENTER = "renter"
PROVIDER = "provider"
ROLES = (NODE, OPERATOR, ROUTER, RENTER, PROVIDER)


@dataclass(frozen=True)
class Identity:
    role: str
    name: str

    def __str__(self) -> str:
        return f"{self.role}:{self.name}"


def parse_common_name(common_name: str) -> Identity | None:
    role, sep, name = common_name.partition(":")
    if not sep or role not in ROLES or not name:
        return None
    return Identity(role, name)


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror}") from e


def server_credentials(cert: str, key: str, client_ca: str) -> grpc.ServerCredentials:
    """Mutual TLS: a client without a certificate signed by client_ca is refused."""
    return grpc.ssl_server_credentials(
        [(_read(key, "TLS key"), _read(cert, "TLS certificate"))],
        root_certificates=_read(client_ca, "client CA"),
        require_client_auth=True,
    )


def channel_credentials(cert: str, key: str, ca: str) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "CA"),
        private_key=_read(key, "TLS key"),
        certificate_chain=_read(cert, "TLS certificate"),
    )


def warn_insecure(program: str) -> None:
    # Said on every start, loudly, so nobody runs plaintext by accident (docs/design.md "Security").
    print(
        f"{program}: WARNING: --insecure: gRPC runs in PLAINTEXT with NO client identity checks. "
        "Use it only on a trusted test network.",
        file=sys.stderr,
        flush=True,
    )
