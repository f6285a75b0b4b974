"""Routes of ``qatune serve``: the OpenAI-compatible API, the extractive endpoint, the page, the run summary; what
they do is the Service's (service.py).

Every error a client can cause is a 4xx answer in the OpenAI error shape
``{"error": {"message", "type", "param", "code"}}``; nothing a request holds reaches a traceback.
Requests pass the Guard (guard.py: Host, API key, Origin, body size) before any route, then the gate (concurrent
requests), then wait in the Batcher's queue.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, HTMLResponse

from qatune.model.folder import LoadedModel
from qatune.serve.guard import Access, Guard
from qatune.serve.request_checks import add_error_handlers
from qatune.serve.schemas import AnswerRequest, ApiError, ChatRequest, CompletionRequest, ExtractRequest
from qatune.serve.service import Limits, Service, Settings

__all__ = ["Limits", "Settings", "create_app"]

log = logging.getLogger("qatune")


def create_app(loaded: LoadedModel, settings: Settings | None = None, guarded: bool = True) -> FastAPI:
    """The ASGI app for one loaded run (``settings``: the defaults of :class:`Settings` if None); its Batcher starts
    and stops with the app's lifespan. ``guarded=False``: an app mounted in another whose guard covers it."""
    from contextlib import asynccontextmanager

    settings = settings or Settings()
    service = Service(loaded, settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        for line in service.request_needs():
            log.info("%s", line)
        service.batcher.start()
        try:
            yield
        finally:
            service.batcher.stop()

    app = FastAPI(title="qatune serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    if guarded:
        app.add_middleware(Guard, access=Access("qatune serve", settings.host, settings.port, settings.allowed_hosts,
                                                api_key=settings.api_key,
                                                max_body_bytes=settings.limits.max_body_bytes))
    add_error_handlers(app)

    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(resources.files("qatune.serve").joinpath("static/index.html").read_text(encoding="utf-8"))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": service.model_id, "in_flight": service.gate.active,
                "waiting": service.batcher.waiting}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [service.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        service.check_model(model_id)
        return service.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        return await service.complete(body, body.question, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest) -> Any:
        return await service.complete(body, body.question, chat=True, system=body.system)

    @app.post("/v1/answer")
    async def answer(body: AnswerRequest) -> dict[str, Any]:
        return await service.answer(body)

    @app.post("/v1/extract")
    async def extract(body: ExtractRequest) -> dict[str, Any]:
        return await service.extract(body)

    @app.get("/run")
    async def run_summary() -> dict[str, Any]:
        return service.summary()

    @app.get("/run/loss.png", include_in_schema=False)
    async def loss_curve() -> FileResponse:
        path = service.run_dir / "loss.png"
        if not path.is_file():
            raise ApiError(404, "this run has no loss.png", code="not_found")
        return FileResponse(path, media_type="image/png")

    return app
