"""Run ``qatune serve``: bind, load, then uvicorn until Ctrl-C (import after qatune.serve.check_installed()).

The socket is bound before the model is loaded, so a port in use is one clear error at once. Ctrl-C
(or SIGTERM) stops accepting connections, lets the requests in flight finish (up to DRAIN_SECONDS;
a second Ctrl-C stops at once) and returns normally: the command exits 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import ipaddress
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from qatune.errors import QatuneError
from qatune.inference.run_model import load_run_model, read_run
from qatune.serve.app import Settings, create_app

log = logging.getLogger("qatune")

DRAIN_SECONDS = 30


def serve(run_dir: str | Path, which: str, host: str, port: int, settings: Settings,
          threads: int | None = None) -> None:
    """Serve a run until interrupted."""
    read_run(run_dir, which)  # a wrong RUN fails before anything else
    sock = bind(host, port)
    try:
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        loaded = load_run_model(run_dir, which)
        bound_host, bound_port = sock.getsockname()[:2]
        app = create_app(loaded, dataclasses.replace(settings, host=host, port=bound_port))
        route_uvicorn_logs()
        config = uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=DRAIN_SECONDS,
                                lifespan="on")
        server = Server(config)
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        service = app.state.service
        log.info("serving %s (%s) at http://%s:%d/  (page: /, API: /v1, batches of up to %d; Ctrl-C stops)",
                 service.model_id, service.model_kind, shown, bound_port, settings.max_batch_size)
        if not is_loopback(host):
            log.warning("warning: listening on %s: anyone who can reach this machine on port %d can use the model%s",
                        host, bound_port, "" if settings.api_key else "; set --api-key KEY to require a key")
        server.run(sockets=[sock])
    finally:
        sock.close()
    log.info("stopped")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise QatuneError(f"cannot listen on '{host}': {exc.strerror}; pass an address of this machine, "
                          "e.g. --host 127.0.0.1") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise QatuneError(f"port {port} on {host} is already in use; stop what uses it or pick another port "
                              "with --port (--port 0 picks a free one)") from None
        if exc.errno == errno.EACCES:
            raise QatuneError(f"not allowed to listen on port {port}; use a port above 1023") from None
        raise QatuneError(f"cannot listen on {host}:{port}: {exc.strerror}; pass an address of this machine, "
                          "e.g. --host 127.0.0.1") from None
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def route_uvicorn_logs() -> None:
    """uvicorn's own messages (bad HTTP, shutdown) go through qatune's handler, warnings only unless -v."""
    for name in ("uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = log.handlers
        logger.setLevel(logging.INFO if log.isEnabledFor(logging.DEBUG) else logging.WARNING)
        logger.propagate = False


class Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """As uvicorn's, minus re-raising the signal after the drain: Ctrl-C is the normal way to stop."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
