"""The request guard of ``qatune serve`` and ``qatune ui``: an ASGI middleware every request passes before any route.

A server on 127.0.0.1 is reachable from every page open in the user's browser. Two kinds of request from such a page
are what the guard stops, in this order:

1. **Host**: a DNS-rebinding page (its own name made to point at 127.0.0.1) sends ``Host: evil.example``. Only the
   names this server is reached by are answered: the loopback names, the address it is bound to, and what
   ``--allowed-host`` adds (a reverse proxy's name); anything else is 403 before anything is read or written.
2. **Secret**: with an API key or the page's token, every request but the open pages (the static page, the liveness
   probe) carries one: ``Authorization: Bearer SECRET``, or the page's cookie, which ``GET /?token=SECRET`` sets
   (HttpOnly, SameSite=Strict, so no other site's request carries it) before sending the browser back to ``/``.
3. **Origin**: a request that can change something (POST, PUT, PATCH, DELETE) from a browser carries its page's
   Origin (or Referer); it must be this server's own page. A request with neither header (``curl``, the ``openai``
   client, a script) passes on the secret alone. A cross-site "simple" request (a form, ``text/plain``, an upload)
   is refused before its body is read.
4. **Body size**: a Content-Length over the limit is refused before the body is read; a body without one is read
   up to the limit, then handed to the route (routes in ``streamed_paths``, uploads, limit their own).

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` (the OpenAI error shape) whose message says which
option allows what was refused.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import socket
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qs, urlsplit

from starlette.datastructures import Headers

from qatune.serve.schemas import error_body

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("", "0.0.0.0", "::")
CHANGING = ("POST", "PUT", "PATCH", "DELETE")
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


@dataclass(frozen=True)
class Access:
    """Who a server answers: the names it is reached by, the secrets it takes, how large a body may be."""

    server: str
    """The command, for messages: ``qatune serve`` or ``qatune ui``."""
    host: str = "127.0.0.1"
    """The address the server is bound to."""
    port: int = 0
    allowed_hosts: tuple[str, ...] = ()
    """Names besides the loopback ones and the bound address (``--allowed-host``): a reverse proxy's."""
    api_key: str | None = None
    token: str | None = None
    """The page's secret (``qatune ui``): printed in the link at start, then kept in a cookie."""
    max_body_bytes: int = 1_000_000
    open_paths: tuple[str, ...] = ("/", "/health")
    """Answered to GET and HEAD without a secret: the page itself (static, the same for everyone) and liveness."""
    streamed_paths: tuple[str, ...] = ()
    """Routes that read and limit their own body (uploads)."""
    names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        names = {*LOOPBACK_NAMES, *(_name(host) for host in self.allowed_hosts)}
        if _name(self.host) not in WILDCARDS:
            names.add(_name(self.host))
        else:  # every address of this machine: its names; its addresses are IP literals, allowed below
            names.update(_name(found) for found in (socket.gethostname(), socket.getfqdn()))
        object.__setattr__(self, "names", frozenset(names))

    @property
    def cookie(self) -> str:
        """Cookies are shared by every port of a host: one name per server."""
        return f"qatune-token-{self.port}"

    @property
    def secrets(self) -> tuple[bytes, ...]:
        return tuple(secret.encode() for secret in (self.api_key, self.token) if secret)

    def host_allowed(self, host_header: str | None) -> bool:
        if not host_header:
            return False
        name = _name(urlsplit(f"//{host_header}").hostname or "")
        if name in self.names:
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return False  # a name: rebinding needs one, so only the names above pass
        return address.is_loopback or _name(self.host) in WILDCARDS


class Guard:
    """The ASGI middleware: Host, secret, Origin, then body size, each refusal in one clear message."""

    def __init__(self, app: Any, access: Access):
        self.app = app
        self.access = access

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        access, headers = self.access, Headers(scope=scope)
        method, path = scope.get("method", "GET"), scope["path"]
        host = headers.get("host")
        if not access.host_allowed(host):
            shown = "no Host header" if not host else f"the Host {host!r}"
            names = ", ".join(sorted(access.names))
            await refuse(send, 403, f"{shown} is not a name {access.server} answers to ({names}); a page that "
                         "reached it under another name is refused (DNS rebinding). To reach it "
                         f"through a proxy under that name, start it with --allowed-host {_hint(host)}",
                         "host_not_allowed")
            return
        if access.token and path == "/" and method in ("GET", "HEAD"):
            given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
            if given is not None:
                await self.exchange(send, given[-1])
                return
        if access.secrets and not (path in access.open_paths and method in ("GET", "HEAD")):
            if not self.authorized(headers):
                await refuse(send, 401, self.secret_message(headers), "invalid_api_key")
                return
        if method in CHANGING and not self.same_origin(headers):
            origin = headers.get("origin") or headers.get("referer")
            await refuse(send, 403, f"a {method} from {origin!r} is refused: only {access.server}'s own page (or a "
                         "script that sends no Origin header) may change anything. A page behind a proxy: start it "
                         f"with --allowed-host {_hint(origin)}", "origin_not_allowed")
            return
        if path in access.streamed_paths or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > access.max_body_bytes):
            await refuse(send, 413 if declared.isdigit() else 400, self.too_large() if declared.isdigit() else
                         "the Content-Length header is not a number", "request_too_large")
            return
        if method not in CHANGING:
            await self.app(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > access.max_body_bytes:
                await refuse(send, 413, self.too_large(), "request_too_large")
                return
        await self.app(scope, replay(body, receive), send)

    def authorized(self, headers: Headers) -> bool:
        scheme, _, given = headers.get("authorization", "").encode("latin-1").partition(b" ")
        # the scheme's name is case-insensitive (RFC 9110), the secret is not
        if scheme.lower() == b"bearer" and self.matches(given.strip()):
            return True
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except Exception:  # a malformed Cookie header is no credential
            return False
        kept = cookie.get(self.access.cookie)
        return kept is not None and self.matches(kept.value.encode("latin-1"))

    def matches(self, given: bytes) -> bool:
        return any(hmac.compare_digest(given, secret) for secret in self.access.secrets)

    def same_origin(self, headers: Headers) -> bool:
        origin = headers.get("origin") or headers.get("referer")
        if origin is None:
            return True  # not sent by a browser's page: the secret (if any) was checked above
        found = urlsplit(origin)
        if not found.scheme or not found.hostname:
            return False  # "null": a sandboxed frame, a file:// page, a redirect across sites
        own = urlsplit(f"//{headers.get('host', '')}")
        if _name(found.hostname) in {_name(h) for h in self.access.allowed_hosts}:
            return True
        port = found.port or DEFAULT_PORTS.get(found.scheme)
        return (_name(found.hostname), port) == (_name(own.hostname or ""), own.port or DEFAULT_PORTS.get(found.scheme))

    async def exchange(self, send: Any, given: str) -> None:
        """``GET /?token=SECRET``: the secret into an HttpOnly, SameSite=Strict cookie, and the browser sent back to
        ``/`` so that the secret leaves the address bar (and the history)."""
        if not self.matches(given.encode("utf-8", "replace")):
            await refuse(send, 401, f"this link's token is not {self.access.server}'s: open the link it printed when "
                         "it started (tokens change at every start)", "invalid_token")
            return
        cookie = (f"{self.access.cookie}={given}; Path=/; HttpOnly; SameSite=Strict").encode("latin-1")
        await send({"type": "http.response.start", "status": 303,
                    "headers": [(b"location", b"/"), (b"set-cookie", cookie), (b"cache-control", b"no-store"),
                                (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    def secret_message(self, headers: Headers) -> str:
        given = "the secret given is not valid" if headers.get("authorization") else "no secret given"
        ways = []
        if self.access.token:
            ways.append(f"open the link {self.access.server} printed when it started (…/?token=…)")
        if self.access.api_key:
            ways.append(f"send the header 'Authorization: Bearer KEY' with the key given to {self.access.server} "
                        "--api-key")
        return f"{given}: {' or '.join(ways)}"

    def too_large(self) -> str:
        return f"the request body is larger than {self.access.server} allows ({self.access.max_body_bytes} bytes)"


def replay(body: bytes, receive: Any) -> Any:
    """``receive`` that gives the body read already, then what the connection says next (a disconnect)."""
    given = False

    async def receive_again() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


async def refuse(send: Any, status: int, message: str, code: str) -> None:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    payload = json.dumps(error_body(message, kind, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def _name(host: str) -> str:
    return host.strip().strip("[]").rstrip(".").lower()


def _hint(given: str | None) -> str:
    """The name to pass to --allowed-host for a Host header or an Origin."""
    if not given:
        return "NAME"
    found = urlsplit(given if "//" in given else f"//{given}")
    return found.hostname or "NAME"
