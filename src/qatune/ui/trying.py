"""The Try step: a run's tuned model behind ``qatune serve``'s own app, mounted at /try. Its page (in a frame of the
ui's page) and its OpenAI-compatible API answer as ``qatune serve RUN`` would, from the ui's process."""

from __future__ import annotations

import asyncio
import json
from contextlib import AsyncExitStack
from importlib import resources
from pathlib import Path
from typing import Any

from qatune.inference.run_model import load_run_model
from qatune.runs import layout
from qatune.serve.app import create_app

MOUNT = "/try"
PREFIX_REQUESTS = (
    "<script>/* qatune ui: this is qatune serve's page, under " + MOUNT + "/ */\n"
    "const serveFetch = window.fetch;\n"
    "window.fetch = (path, options) => serveFetch(typeof path === 'string' && path.startsWith('/') ? '" + MOUNT
    + "' + path : path, options);\n</script>\n"
)
"""Put before serve's page's own script: its requests (to /run, /v1/...) go to the app mounted here."""


def serve_page() -> str:
    """``qatune serve``'s page, its requests sent under /try."""
    page = resources.files("qatune.serve").joinpath("static/index.html").read_text(encoding="utf-8")
    return page.replace("<head>", "<head>\n" + PREFIX_REQUESTS, 1)


class Trying:
    """An ASGI app: serve's app of the run loaded last, or a 409 saying how to load one. The ui's guard covers it."""

    def __init__(self) -> None:
        self.app: Any = None
        self.loaded_from: tuple[str, float] | None = None
        self.stack: AsyncExitStack | None = None
        self.lock = asyncio.Lock()

    @property
    def run(self) -> str | None:
        return self.loaded_from[0] if self.loaded_from else None

    async def load(self, run_dir: Path, name: str) -> None:
        """Load RUN/final (again when it was written since) behind /try; its batcher starts with it."""
        final = run_dir / layout.FINAL
        key = (name, final.stat().st_mtime if final.exists() else 0.0)
        async with self.lock:
            if key == self.loaded_from:
                return
            loaded = await asyncio.to_thread(load_run_model, run_dir)
            app = create_app(loaded, guarded=False)
            stack = AsyncExitStack()
            await stack.enter_async_context(app.router.lifespan_context(app))
            previous, self.stack = self.stack, stack
            self.app, self.loaded_from = app, key
            if previous is not None:
                await previous.aclose()

    async def close(self) -> None:
        if self.stack is not None:
            await self.stack.aclose()
            self.stack, self.app, self.loaded_from = None, None, None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.app is not None or scope["type"] != "http":
            if self.app is not None:
                await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": "no model is loaded to try yet: open the Try step of a run with a "
                                                "final/ model", "type": "invalid_request_error", "param": None,
                                     "code": "no_model"}}).encode()
        await send({"type": "http.response.start", "status": 409,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
