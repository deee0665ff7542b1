"""Who may see the dashboard, what it may show, and who may start a drill.

* :func:`check_bind`: 127.0.0.1 by default; a non-loopback address only
  with a token.
* :func:`token_ok`: the token compared in constant time.
* :func:`csrf_ok`: the drill form's double-submit token (cookie and form
  field, compared in constant time) plus an Origin check.
* :func:`redact`: credentials in any URL-looking text replaced by ``***``.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
from urllib.parse import urlsplit

from ckptier.storage.errors import ConfigError

TOKEN_ENV = "CKPTIER_DASHBOARD_TOKEN"
TOKEN_COOKIE = "ckptier_token"
CSRF_COOKIE = "ckptier_csrf"
CSRF_FIELD = "csrf"
#: A token shorter than this is refused: it could be guessed.
MIN_TOKEN_LENGTH = 16

_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^/@:\s]*):(?P<secret>[^@\s]+)@")
_SECRET_PARAM = re.compile(
    r"(?P<key>[?&;](?:[A-Za-z0-9_\-]*(?:signature|credential|token|secret|password|passwd|sig|key|auth)[A-Za-z0-9_\-]*)=)"
    r"(?P<value>[^&#\s'\"]+)",
    re.IGNORECASE,
)


def redact(text: str | None) -> str | None:
    """``text`` with every URL password and secret-looking query value replaced by ``***``.

    ``postgresql://ckptier:s3cret@db/c`` → ``postgresql://ckptier:***@db/c``;
    ``https://b.s3/k?X-Amz-Signature=abc`` → ``...?X-Amz-Signature=***``.
    Works on free text (event messages, reasons) as well as on URLs.
    """
    if not text:
        return text
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    return _SECRET_PARAM.sub(lambda m: f"{m['key']}***", text)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve on a non-loopback address without a token, or with a weak one.

    Raises :class:`ConfigError` (one line, naming the host and the fix).
    """
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(
            f"dashboard token is {len(token)} characters; use at least {MIN_TOKEN_LENGTH}, e.g. "
            "python -c 'import secrets; print(secrets.token_urlsafe(24))'"
        )
    if not is_loopback(host) and not token:
        raise ConfigError(
            f"refusing to serve the dashboard on {host!r}, which is not a loopback address, without a token: "
            f"pass --token or set {TOKEN_ENV} (anyone who can reach the port could read the catalog), "
            "or bind --host 127.0.0.1"
        )


def token_ok(given: str | None, token: str) -> bool:
    """Constant-time comparison of a presented token with the configured one."""
    if not given:
        return False
    return hmac.compare_digest(given.encode("utf-8"), token.encode("utf-8"))


def new_csrf() -> str:
    """A fresh double-submit token for the drill form."""
    return secrets.token_urlsafe(32)


def csrf_ok(cookie: str | None, field: str | None, *, origin: str | None, host: str | None,
            fetch_site: str | None) -> str | None:
    """Why a state-changing POST must be refused, or None when it may proceed.

    The form's field must equal the cookie (both present, constant-time);
    a browser's ``Sec-Fetch-Site: cross-site`` is refused; an ``Origin``
    header, when sent, must name this host.
    """
    if fetch_site is not None and fetch_site.lower() == "cross-site":
        return "cross-site request"
    if origin and origin != "null":
        if host is None or urlsplit(origin).netloc.lower() != host.lower():
            return f"request from another origin ({origin})"
    elif origin == "null":
        return "request from an opaque origin"
    if not cookie or not field:
        return "missing CSRF token (reload the page and try again)"
    if not hmac.compare_digest(cookie.encode("utf-8"), field.encode("utf-8")):
        return "CSRF token does not match (reload the page and try again)"
    return None
