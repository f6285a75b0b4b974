"""Run ``qatune ui``: check the address, bind, then uvicorn until Ctrl-C (import after qatune.ui.check_installed()).

Ctrl-C (or SIGTERM) stops the server; a training still running is asked to stop as the page's Stop button does (it
writes a checkpoint, and the page resumes it later), and the command exits 0.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from pathlib import Path

import uvicorn

from qatune.errors import QatuneError
from qatune.serve.server import Server, bind, is_loopback, route_uvicorn_logs
from qatune.ui.app import UiSettings, create_app
from qatune.ui.workspace import Workspace

log = logging.getLogger("qatune")


def serve_ui(workspace_dir: str | Path, host: str, port: int, settings: UiSettings, token: bool = True) -> None:
    """Serve the page on host:port, working in ``workspace_dir``, until interrupted. ``token``: make the page's secret
    for this start and print the link that carries it (``--no-token``: the page opens to every request that passes the
    Host and Origin checks)."""
    if not is_loopback(host) and settings.api_key is None:
        raise QatuneError(f"--host {host}: the page trains models and reads and writes the workspace, so beyond this "
                          "machine it needs a key: pass --api-key KEY (or set QATUNE_API_KEY), or leave --host at "
                          "127.0.0.1")
    if settings.api_key is not None and not settings.api_key.strip():
        raise QatuneError("--api-key is empty; pass a key, or leave the option out")
    workspace = Workspace(workspace_dir)
    sock = bind(host, port)
    try:
        bound_host, bound_port = sock.getsockname()[:2]
        settings = dataclasses.replace(settings, host=host, port=bound_port,
                                       token=secrets.token_urlsafe(32) if token else None)
        app = create_app(workspace, settings)
        route_uvicorn_logs()
        server = Server(uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=5,
                                       lifespan="on"))
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        link = f"http://{shown}:{bound_port}/" + (f"?token={settings.token}" if settings.token else "")
        log.info("qatune ui at %s  (workspace %s; Ctrl-C stops it, a training with a checkpoint)", link,
                 workspace.root)
        if not token:
            log.warning("warning: --no-token: the page answers every request from this machine without a secret: any "
                        "program or user on it can train, read and write %s (web pages of other sites are still "
                        "refused by the Host and Origin checks)%s", workspace.root,
                        "; the API key is still asked for" if settings.api_key else "")
        server.run(sockets=[sock])
    finally:
        sock.close()
    log.info("stopped")
