"""The request guard of ``qatune serve`` and ``qatune ui``: an ASGI middleware every request passes before any route.

A server on 127.0.0.1 is reachable from every page open in the user's browser. What the guard checks, in this order:

1. **Host**: a DNS-rebinding page (its own name made to point at 127.0.0.1) sends ``Host: evil.example``. Only the
   names this server is reached by are answered: the loopback names, the address it is bound to, and what
   ``--allowed-host`` adds (a reverse proxy's name); anything else is 403 before anything is read or written.
2. **Secret**: with an API key or the page's token, every request but the open pages (the static page, the liveness
   probe) carries one: ``Authorization: Bearer SECRET``, or the page's cookie, which ``GET /?token=TOKEN`` sets
   (HttpOnly, SameSite=Strict, so no other site's request carries it) before sending the browser back to ``/``.
3. **Site**: a request a browser marks as sent by another site's page (``Sec-Fetch-Site``: ``cross-site``, or
   ``same-site`` for another port of this host) is refused, reads included, but for the open pages.
4. **Origin**: a request that can change something (POST, PUT, PATCH, DELETE) from a browser carries its page's
   Origin (or Referer); it must be this server's own page. A request with neither header (``curl``, the ``openai``
   client, a script) passes on the secret alone. A cross-site "simple" request (a form, ``text/plain``, an upload)
   is refused before its body is read.
5. **Body size**: a Content-Length over the limit is refused before the body is read; a body without one is read
   up to the limit, then handed to the route (routes in ``streamed_paths``, uploads, limit their own).

Every answer forbids other sites to show it in a frame (``X-Frame-Options``, CSP ``frame-ancestors``), and a
WebSocket (no route takes one) is closed at once.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` (the OpenAI error shape) whose message says which
option allows what was refused.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from starlette.datastructures import Headers

from qatune.errors import QatuneError
from qatune.serve.schemas import error_body

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("", "0.0.0.0", "::")
CHANGING = ("POST", "PUT", "PATCH", "DELETE")
DEFAULT_PORTS = {"http": 80, "https": 443}
HOST = re.compile(r"(?P<name>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::(?P<port>[0-9]{1,5}))?")
"""A Host header as browsers send it: a name or an address, and a port."""
NAME = re.compile(r"[A-Za-z0-9._-]+")
FRAMING = [(b"x-frame-options", b"SAMEORIGIN"), (b"content-security-policy", b"frame-ancestors 'self'")]
"""On every answer: no other site's page may show this one in a frame (and have the user click in it)."""
BROWSER_SITES = ("same-origin", "none")
"""``Sec-Fetch-Site`` of the requests a page sends to its own server, and of what the user typed or clicked outside
any page; another site's page sends ``same-site`` (another port of the same host) or ``cross-site``."""


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
        for given in self.allowed_hosts:
            if not NAME.fullmatch(given):
                raise QatuneError(f"--allowed-host {given!r}: give a name as a browser's address bar shows it, without "
                                 "scheme, port or path, e.g. --allowed-host qatune.example.org")
        names = {*LOOPBACK_NAMES, *(_name(host) for host in self.allowed_hosts)}
        if not self.wildcard:
            names.add(_name(self.host))
        else:  # every address of this machine: its names; its addresses are IP literals, allowed below
            names.update(_name(found) for found in (socket.gethostname(), socket.getfqdn()))
        object.__setattr__(self, "names", frozenset(names))

    @property
    def wildcard(self) -> bool:
        return _name(self.host) in WILDCARDS

    @property
    def shown_names(self) -> str:
        """The names answered, as a refusal lists them (not this machine's own names, which a page could read)."""
        shown = [*LOOPBACK_NAMES, *([] if self.wildcard else [_name(self.host)]), *self.allowed_hosts]
        return ", ".join(dict.fromkeys(shown)) + (", this machine's names and addresses" if self.wildcard else "")

    @property
    def cookie(self) -> str:
        """Cookies are shared by every port of a host: one name per server."""
        return f"qatune-token-{self.port}"

    @property
    def secrets(self) -> tuple[bytes, ...]:
        return tuple(secret.encode() for secret in (self.api_key, self.token) if secret)

    def host_allowed(self, host_header: str | None) -> bool:
        found = HOST.fullmatch(host_header or "")
        if found is None or int(found.group("port") or 0) > 65535:
            return False
        name = _name(found.group("name"))
        if name in self.names:
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return False  # a name: rebinding needs one, so only the names above pass
        return address.is_loopback or self.wildcard


class Guard:
    """The ASGI middleware: Host, secret, Origin, then body size, each refusal in one clear message."""

    def __init__(self, app: Any, access: Access):
        self.app = app
        self.access = access

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":  # no route takes one: closed before anything else reads it
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = framed(send)
        refusal = self.refusal(scope, Headers(scope=scope))
        if refusal is not None:
            if refusal == "exchange":
                await self.exchange(scope, send)
            else:
                await refuse(send, *refusal)
            return
        if scope["path"] in self.access.streamed_paths or scope["method"] not in CHANGING:
            await self.app(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.access.max_body_bytes:
                await refuse(send, 413, self.too_large(), "request_too_large")
                return
        await self.app(scope, replay(body, receive), send)

    def refusal(self, scope: dict[str, Any], headers: Headers) -> tuple[int, str, str] | str | None:
        """Why the request is refused (status, message, code), ``"exchange"`` for the page's token link, or None."""
        access, method, path = self.access, scope["method"], scope["path"]
        host = headers.get("host")
        if not access.host_allowed(host):
            shown = "no Host header" if not host else f"the Host {host!r}"
            return (403, f"{shown} is not a name {access.server} answers to ({access.shown_names}); a page that "
                         "reached it under another name is refused (DNS rebinding). To reach it through a proxy under "
                         f"that name, start it with --allowed-host {_hint(host)}", "host_not_allowed")
        reads_page = path in access.open_paths and method in ("GET", "HEAD")
        if reads_page and access.token and path == "/" and "token" in parse_qs(scope.get("query_string", b"").decode(
                "latin-1")):
            return "exchange"
        if access.secrets and not reads_page and not self.authorized(headers):
            return 401, self.secret_message(headers), "invalid_api_key"
        if not reads_page and headers.get("sec-fetch-site", "same-origin") not in BROWSER_SITES:
            return (403, f"a request from another site's page is refused: only {access.server}'s own page may use it "
                         "(sent by the browser as Sec-Fetch-Site: " + headers["sec-fetch-site"] + ")",
                    "origin_not_allowed")
        if method in CHANGING and not self.same_origin(headers):
            origin = headers.get("origin") or headers.get("referer")
            return (403, f"a {method} from {origin!r} is refused: only {access.server}'s own page (or a script that "
                         "sends no Origin header) may change anything. A page behind a proxy: start it with "
                         f"--allowed-host {_hint(origin)}", "origin_not_allowed")
        declared = headers.get("content-length")
        if path not in access.streamed_paths and declared is not None:
            if not (declared.isascii() and declared.isdigit()):
                return 400, "the Content-Length header is not a number", "invalid_header"
            if int(declared) > access.max_body_bytes:
                return 413, self.too_large(), "request_too_large"
        return None

    def authorized(self, headers: Headers) -> bool:
        scheme, _, given = headers.get("authorization", "").partition(" ")
        # the scheme's name is case-insensitive (RFC 9110), the secret is not
        if scheme.lower() == "bearer" and self.matches(given.strip(), self.access.secrets):
            return True
        token = self.access.token
        if not token:
            return False
        # parsed as browsers write cookies (another app's cookie on this host does not hide ours); any of ours counts
        values = [value for name, value in _cookies(headers) if name == self.access.cookie]
        return any(self.matches(value, (token.encode(),)) for value in values)

    @staticmethod
    def matches(given: str, secrets: tuple[bytes, ...]) -> bool:
        encoded = given.encode("utf-8", "replace")
        return any(hmac.compare_digest(encoded, secret) for secret in secrets)

    def same_origin(self, headers: Headers) -> bool:
        origin = headers.get("origin") or headers.get("referer")
        if origin is None:
            return True  # not sent by a browser's page: the secret (if any) was checked above
        try:
            found = urlsplit(origin)
            port = found.port or DEFAULT_PORTS.get(found.scheme)
        except ValueError:  # a port that is no number, or out of range
            return False
        if found.scheme not in DEFAULT_PORTS or not found.hostname:
            return False  # "null": a sandboxed frame, a file:// page, a redirect across sites; an extension
        if _name(found.hostname) in {_name(h) for h in self.access.allowed_hosts}:
            return True  # the proxy's name: its port is the proxy's own
        own = HOST.fullmatch(headers.get("host", ""))
        if own is None:
            return False
        own_port = int(own.group("port") or DEFAULT_PORTS[found.scheme])
        return (_name(found.hostname), port) == (_name(own.group("name")), own_port)

    async def exchange(self, scope: dict[str, Any], send: Any) -> None:
        """``GET /?token=TOKEN``: the token into an HttpOnly, SameSite=Strict cookie, and the browser sent back to
        ``/`` so that the token leaves the address bar (and the history)."""
        given = parse_qs(scope.get("query_string", b"").decode("latin-1"))["token"][-1]
        token = self.access.token or ""
        if not self.matches(given, (token.encode(),)):
            await refuse(send, 401, f"this link's token is not {self.access.server}'s: open the link it printed when "
                         "it started (tokens change at every start)", "invalid_token")
            return
        cookie = f"{self.access.cookie}={token}; Path=/; HttpOnly; SameSite=Strict".encode("ascii")
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


def framed(send: Any) -> Any:
    """``send`` that adds FRAMING to every answer's headers."""

    async def send_framed(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *FRAMING]}
        await send(message)

    return send_framed


def _cookies(headers: Headers) -> list[tuple[str, str]]:
    found = []
    for line in headers.getlist("cookie"):
        for chunk in line.split(";"):
            name, _, value = chunk.strip().partition("=")
            found.append((name.strip(), value.strip()))
    return found


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
    try:
        name = urlsplit(given if "//" in given else f"//{given}").hostname if given else None
    except ValueError:
        name = None
    return name if name and NAME.fullmatch(name) else "NAME"
