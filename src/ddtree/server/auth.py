"""API keys: a user key for every route but ``/health`` and ``/metrics``, an admin key for routes that change state.

Rules (what vLLM's ``--api-key`` and SGLang's ``--admin-api-key`` do, in one table):

=====================  ===============================  =========================================================
route                  no key configured                key configured
=====================  ===============================  =========================================================
``/health``,           open                             open (load balancers and Prometheus poll them; they
``/metrics``                                            reveal no prompt or output)
any other route        open                             ``Authorization: Bearer <api key>`` (the admin key works too)
admin routes           open only if the server listens  ``Bearer <admin key>``; without an admin key, the user
(``POST               on loopback; else 403             key on a loopback-only server, 403 on an exposed one
/server_config``,
stats resets)
=====================  ===============================  =========================================================

Keys are compared with :func:`hmac.compare_digest` (time independent of where the strings differ). A missing or
wrong key is a 401 with ``WWW-Authenticate: Bearer``; the user key on an admin route is a 403. Checked in an ASGI
middleware before the body is read, so an unauthenticated client cannot make the server read a large body.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from ddtree.errors import ConfigError
from ddtree.server.limits import ASGIApp, send_json
from ddtree.server.protocol import error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})
# (method or None for any, path): routes that change or reset server state.
ADMIN_ROUTES = frozenset({("POST", "/server_config"), (None, "/flush_cache"), (None, "/reset_prefix_cache")})


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` reaches this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def is_admin_route(method: str, path: str) -> bool:
    return (method, path) in ADMIN_ROUTES or (None, path) in ADMIN_ROUTES


@dataclass(frozen=True)
class AccessPolicy:
    """Who may call what. ``loopback_only``: the server listens on loopback alone (``serve_app`` checks that
    it does), which is what lets admin routes stay open without an admin key."""

    api_key: str | None = None
    admin_api_key: str | None = None
    loopback_only: bool = True

    def validated(self) -> AccessPolicy:
        for name in ("api_key", "admin_api_key"):
            key = getattr(self, name)
            if key is not None and (not isinstance(key, str) or not key.strip()):
                raise ConfigError(f"{name} must be a non-empty string (or unset)")
        if self.api_key is not None and self.api_key == self.admin_api_key:
            raise ConfigError("the admin API key must differ from the API key, or every user is an admin")
        return self

    def check(self, method: str, path: str, authorization: str | None) -> tuple[int, str, str] | None:
        """None when the request may proceed, else (status, message, code)."""
        if path in OPEN_PATHS:
            return None
        token = _bearer(authorization)
        is_user = _matches(token, self.api_key)
        is_admin = _matches(token, self.admin_api_key)
        if is_admin_route(method, path):
            if self.admin_api_key is not None:
                if is_admin:
                    return None
                if is_user:
                    return 403, f"{method} {path} changes server state and needs the admin API key", "admin_key_required"
                return 401, _missing(token, "admin API key"), "invalid_api_key"
            if not self.loopback_only:
                return (403, f"{method} {path} changes server state; a server listening beyond loopback serves it "
                             "only with --admin-api-key set", "admin_key_not_configured")
        if self.api_key is None or is_user or is_admin:
            return None
        return 401, _missing(token, "API key"), "invalid_api_key"


def _bearer(authorization: str | None) -> str | None:
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str | None, key: str | None) -> bool:
    if key is None or token is None:
        return False
    return hmac.compare_digest(token.encode(), key.encode())


def _missing(token: str | None, what: str) -> str:
    if token is None:
        return f"missing {what}: send the header 'Authorization: Bearer <key>'"
    return f"invalid {what}"


class AuthMiddleware:
    """Applies an :class:`AccessPolicy` to every HTTP request before the app (and the body limit) sees it.
    ``on_refused(path, outcome)`` is called for each refusal (metrics)."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy, on_refused: Callable[[str], None]) -> None:
        self.app = app
        self.policy = policy
        self.on_refused = on_refused

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] == "http":
            authorization = None
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    authorization = value.decode("latin-1")
                    break
            refusal = self.policy.check(scope["method"], scope["path"], authorization)
            if refusal is not None:
                status, message, code = refusal
                self.on_refused(scope["path"])
                headers = [(b"www-authenticate", b"Bearer")] if status == 401 else []
                kind = "authentication_error" if status == 401 else "permission_error"
                await send_json(send, status, error_body(message, type_=kind, code=code), headers)
                return
        await self.app(scope, receive, send)
