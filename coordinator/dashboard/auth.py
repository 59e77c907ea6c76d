"""The operator credential: a token file, compared in constant time.

Why a token and not mutual TLS: the dashboard is for a person at a browser, on loopback by
default; a client certificate in a browser is hard to install and to revoke one at a time,
while a token file is one `install -m 0600` and one restart to rotate. Actions are POSTs that
carry the token in a header the page's own script sets (`X-Spotdrain-Token`), never a cookie:
another site's page cannot make a browser send it, so there is nothing to forge (CSRF), and a
GET never changes anything.
"""

from __future__ import annotations

import hmac
import os
import stat

TOKEN_HEADER = "X-Spotdrain-Token"
MIN_TOKEN_CHARS = 16


class TokenError(ValueError):
    pass


def load_token(path: str) -> str:
    """The token in `path` (surrounding whitespace dropped). Refused when short, or when the file
    can be read by others than its owner and group."""
    try:
        info = os.stat(path)
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise TokenError(f"--dashboard-token-file {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise TokenError(f"--dashboard-token-file {path}: not UTF-8 text") from e
    if info.st_mode & stat.S_IROTH:
        raise TokenError(f"--dashboard-token-file {path}: readable by everyone (chmod 0600)")
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise TokenError(
            f"--dashboard-token-file {path}: the token must be one word of at least "
            f"{MIN_TOKEN_CHARS} characters (e.g. `openssl rand -hex 32`)"
        )
    return token


def token_matches(expected: str | None, given: str | None) -> bool:
    """Constant time in the token's content; no token configured matches nothing."""
    if not expected or not given:
        return False
    return hmac.compare_digest(expected.encode(), given.encode())
