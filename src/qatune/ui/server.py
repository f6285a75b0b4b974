"""Run ``qatune ui``: check the address, bind, then uvicorn until Ctrl-C (import after qatune.ui.check_installed()).

Ctrl-C (or SIGTERM) stops the server; a training still running is asked to stop as the page's Stop button does (it
writes a checkpoint, and the page resumes it later), and the command exits 0.
"""

from __future__ import annotations

import logging
from pathlib import Path

import uvicorn

from qatune.errors import QatuneError
from qatune.serve.server import Server, bind, is_loopback
from qatune.ui.app import UiSettings, create_app
from qatune.ui.workspace import Workspace

log = logging.getLogger("qatune")


def serve_ui(workspace_dir: str | Path, host: str, port: int, settings: UiSettings) -> None:
    """Serve the page on host:port, working in ``workspace_dir``, until interrupted."""
    if not is_loopback(host) and settings.api_key is None:
        raise QatuneError(f"--host {host}: the page trains models and reads and writes the workspace, so beyond this "
                          "machine it needs a key: pass --api-key KEY (or set QATUNE_API_KEY), or leave --host at "
                          "127.0.0.1")
    if settings.api_key is not None and not settings.api_key.strip():
        raise QatuneError("--api-key is empty; pass a key, or leave the option out")
    workspace = Workspace(workspace_dir)
    sock = bind(host, port)
    try:
        app = create_app(workspace, settings)
        for name in ("uvicorn", "uvicorn.error"):  # uvicorn's own messages through qatune's handler, warnings only
            logger = logging.getLogger(name)
            logger.handlers[:] = log.handlers
            logger.setLevel(logging.INFO if log.isEnabledFor(logging.DEBUG) else logging.WARNING)
            logger.propagate = False
        server = Server(uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=5,
                                       lifespan="on"))
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        log.info("qatune ui at http://%s:%d/  (workspace %s; Ctrl-C stops it, a training with a checkpoint)",
                 shown, bound_port, workspace.root)
        server.run(sockets=[sock])
    finally:
        sock.close()
    log.info("stopped")
