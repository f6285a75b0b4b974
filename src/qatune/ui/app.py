"""Routes of ``qatune ui``: the page and its script and style, the JSON API the page uses (/api/...), and the tuned
model under /try (serve's page and API, trying.py).

Every error a request can cause is a 4xx answer ``{"error": {"message": ...}}`` that the page shows where it
happened; anything else is a 500 whose details go to the server's log only.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.routing import Mount

from qatune.data.tables import read_table
from qatune.errors import QatuneError
from qatune.serve.guard import Access, Guard
from qatune.ui import PageError, sheet, steps
from qatune.ui.jobs import Job, Jobs
from qatune.ui.preconditions import refuse_remote_code_of_file, refuse_remote_code_of_run, require_passed_check
from qatune.ui.progress import BAR, training_progress
from qatune.ui.trying import MOUNT, Trying, serve_page
from qatune.ui.workspace import EXPORTS, LOGS, RUNS, SHEETS, Workspace

log = logging.getLogger("qatune")

STATIC = {"ui.js": "text/javascript", "ui.css": "text/css"}
OPEN_PATHS = ("/", "/health", "/static/ui.js", "/static/ui.css", f"{MOUNT}/")
"""What answers without the token or key: the page and its files (static; it asks for the key) and the liveness
probe."""
UPLOAD_PATH = "/api/sheets"
DOWNLOADABLE = (sheet.CONFIGS, SHEETS, RUNS, EXPORTS)


@dataclass(frozen=True)
class UiSettings:
    api_key: str | None = None
    token: str | None = None
    """The page's secret, made at each start (``--no-token``: None); the link printed at start carries it."""
    max_upload_bytes: int = 100 * 2**20
    max_body_bytes: int = 1_000_000
    """Every request but an upload."""
    host: str = "127.0.0.1"
    """The address listened on, and the port: the names the page answers to (serve/guard.py)."""
    port: int = 0
    allowed_hosts: tuple[str, ...] = ()

    def access(self) -> Access:
        return Access("qatune ui", self.host, self.port, self.allowed_hosts, api_key=self.api_key, token=self.token,
                      max_body_bytes=self.max_body_bytes, open_paths=OPEN_PATHS, streamed_paths=(UPLOAD_PATH,))


@dataclass
class Project:
    """What the page works on: the step it reached, so that a page closed or reloaded comes back to it."""

    sheet: str | None = None
    sheet_name: str | None = None
    config: str | None = None
    run: str | None = None
    described: dict[str, Any] | None = None
    written: dict[str, Any] | None = None
    answered: list[str] = field(default_factory=list)


class ConfigBody(BaseModel):
    config: str


class TrainBody(BaseModel):
    config: str | None = None
    resume: str | None = None
    """A stopped run to continue (``qatune train --resume RUN``)."""
    overwrite: bool = False
    """Replace the config's run directory (``--overwrite``): train it again from the start."""


class RunBody(BaseModel):
    run: str


class CompareBody(BaseModel):
    run: str
    other: str = "base"
    sheet: str | None = None
    """An uploaded sheet to compare on; the run's held-out rows when None."""


class TasksQuery(BaseModel):
    sheet_name: str | None = None
    delimiter: str | None = None
    question: str = ""
    answer: str = ""
    context: str | None = None


class AnswerBody(BaseModel):
    run: str
    sheet: str


class ExportBody(BaseModel):
    run: str
    quant: str = "f16"


class YamlBody(BaseModel):
    yaml: str


def create_app(workspace: Workspace, settings: UiSettings = UiSettings()) -> FastAPI:
    jobs = Jobs(workspace)
    trying = Trying()
    project = Project()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await trying.close()
            await asyncio.to_thread(jobs.shutdown)

    app = FastAPI(title="qatune ui", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.jobs, app.state.project, app.state.workspace = jobs, project, workspace
    access = settings.access()
    app.add_middleware(Guard, access=access)
    _add_error_handlers(app)

    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(_static("index.html"))

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in STATIC:
            raise PageError(f"no file /static/{name}", 404)
        return Response(_static(name), media_type=STATIC[name])

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict[str, Any]:
        return {"status": "ok", "running": len(jobs.running())}

    @app.get(f"{MOUNT}/", include_in_schema=False)
    async def try_page() -> HTMLResponse:
        return HTMLResponse(serve_page())

    app.router.routes.append(Mount(MOUNT, app=trying))

    @app.get("/api/state")
    async def state(config: str | None = None) -> dict[str, Any]:
        """Everything a tab shows besides a step's own results; ``config``: the config its Train step would start
        (the one written last, by any tab, when None)."""
        latest = {kind: jobs.latest(kind) for kind in ("check", "train", "compare", "answer", "export")}
        return {"workspace": str(workspace.root), "key_required": bool(access.secrets),
                "max_upload_bytes": settings.max_upload_bytes, "project": project.__dict__,
                "sheets": workspace.sheets(), "runs": await run_in_threadpool(workspace.runs),
                "trying": trying.run, "jobs": {kind: job_json(job) for kind, job in latest.items() if job is not None},
                "training": training_summary(latest["train"]),
                "trainable": trainable(config or project.written["config"]) if config or project.written else None}

    def training_summary(job: Job | None) -> dict[str, Any] | None:
        """The training that runs (every tab shows it): its run, step and time left."""
        if job is None or job.state != "running":
            return None
        bar = next((m for line in reversed(job.log_lines(20)) if (m := BAR.search(line))), None)
        return {"run": job.target, "job": job.id, "stopping": job.stopping,
                "step": int(bar.group(1)) if bar else None, "total_steps": int(bar.group(2)) if bar else None,
                "validating": job.row_bar()}

    def trainable(config: str) -> dict[str, Any]:
        """Whether the Train step may start ``config`` now, and why not (no refusal to meet after a click)."""
        try:
            require_passed_check(jobs, workspace, config)
        except PageError as exc:
            return {"config": config, "ok": False, "why": str(exc)}
        running = jobs.running("train")
        if running:
            return {"config": config, "ok": False, "why": f"a training is running ({running[0].target}); one at a "
                                                          "time: it starts once that one ends or is stopped"}
        return {"config": config, "ok": True, "why": None}

    @app.post(UPLOAD_PATH)
    async def upload(request: Request, name: str, purpose: str = "train") -> dict[str, Any]:
        """A sheet to train on (read, and its columns guessed), or with ``purpose=answer`` one to answer (read, to
        know it can be). One that cannot be read is not kept; the same file again is the one already there."""
        saved = await workspace.save_upload(name, request.stream(), settings.max_upload_bytes)
        upload = {"sheet": saved.name, "uploaded_as": name, "reused": saved.reused, "renamed": saved.renamed}
        try:
            if purpose == "answer":
                await run_in_threadpool(readable, saved.name)
                return upload
            described = await run_in_threadpool(describe, saved.name, None, None)
        except Exception:
            if not saved.reused:  # the upload made it: nothing unreadable stays to fill later lists
                workspace.remove_sheet(saved.name)
            raise
        project.sheet, project.sheet_name, project.described, project.written = saved.name, None, described, None
        return {**described, "upload": upload}

    @app.get("/api/sheets/{name}")
    async def sheet_columns(name: str, sheet_name: str | None = None, delimiter: str | None = None
                            ) -> dict[str, Any]:
        described = await run_in_threadpool(describe, name, sheet_name, delimiter)
        project.sheet, project.sheet_name, project.described = name, sheet_name, described
        return described

    @app.get("/api/sheets/{name}/tasks")
    async def sheet_tasks(name: str, query: Annotated[TasksQuery, Query()]) -> dict[str, Any]:
        """The tasks and models for the columns chosen on the page (asked again as they change)."""
        return await run_in_threadpool(read_errors, name, sheet.sheet_tasks, workspace, name, query.sheet_name,
                                       query.delimiter, query.question, query.answer, query.context)

    def describe(name: str, sheet_name: str | None, delimiter: str | None) -> dict[str, Any]:
        return read_errors(name, sheet.describe, workspace, name, sheet_name, delimiter)

    def readable(name: str) -> None:
        read_errors(name, read_table, workspace.sheet(name))

    def read_errors(name: str, read: Any, *args: Any) -> Any:
        try:
            return read(*args)
        except QatuneError:
            raise
        except Exception as exc:  # a reader's own error on a damaged file: its message, on the page
            log.debug("reading %s", name, exc_info=True)
            raise PageError(sheet.read_error_message(exc, name)) from None

    @app.post("/api/configs")
    async def write_config(choices: sheet.Choices) -> dict[str, Any]:
        written = await run_in_threadpool(sheet.write_page_config, workspace, choices)
        project.sheet, project.sheet_name = choices.sheet, choices.sheet_name
        project.config, project.run, project.written = written["config"], written["run"], written
        return written

    @app.get("/api/configs/{name:path}")
    async def read_config(name: str) -> dict[str, Any]:
        path = workspace.existing(name, "config")
        return {"config": name, "yaml": path.read_text(encoding="utf-8")}

    @app.put("/api/configs/{name:path}")
    async def edit_config(name: str, body: YamlBody) -> dict[str, Any]:
        saved = await run_in_threadpool(sheet.save_edited_config, workspace, name, body.yaml)
        if project.written and project.written["config"] == name:
            project.written = {**project.written, "yaml": saved["yaml"]}
        return saved

    @app.post("/api/check")
    async def check(body: ConfigBody) -> dict[str, Any]:
        path = workspace.existing(body.config, "config")
        await run_in_threadpool(refuse_remote_code_of_file, path, body.config, f"qatune check --config {body.config}")
        return job_json(jobs.start("check", steps.check_args(body.config), body.config, digest=steps.digest(path)))

    @app.post("/api/train")
    async def train(body: TrainBody) -> dict[str, Any]:
        if body.resume is not None:
            run = f"{RUNS}/{workspace.run(body.resume.removeprefix(f'{RUNS}/')).name}"
            await run_in_threadpool(refuse_remote_code_of_run, workspace, run, f"qatune train --resume {run}")
            job = jobs.start("train", steps.train_args(None, run, False), run)
        else:
            if body.config is None:
                raise PageError("pass the config to train, or a run to resume")
            await run_in_threadpool(refuse_remote_code_of_file, workspace.existing(body.config, "config"), body.config)
            require_passed_check(jobs, workspace, body.config)
            run = await run_in_threadpool(steps.config_run, workspace, body.config)
            job = jobs.start("train", steps.train_args(body.config, None, body.overwrite), run)
        project.run = run
        return job_json(job)

    @app.get("/api/jobs/{job_id}")
    async def job_status(job_id: str) -> dict[str, Any]:
        return await run_in_threadpool(job_json, jobs.get(job_id), True)

    @app.post("/api/jobs/{job_id}/stop")
    async def stop(job_id: str) -> dict[str, Any]:
        job = jobs.get(job_id)
        jobs.stop(job)
        return job_json(job)

    @app.get("/api/runs/{name}/progress")
    async def progress(name: str) -> dict[str, Any]:
        run_dir = workspace.path(f"{RUNS}/{name}")  # not there before its training starts: nothing logged yet
        job = jobs.latest("train", f"{RUNS}/{name}")
        found = await run_in_threadpool(training_progress, run_dir, job.log_lines(50) if job else [],
                                        job.row_bar() if job else None)
        return {**found, "run": f"{RUNS}/{name}", "job": job_json(job) if job else None}

    @app.post("/api/runs/{name}/open")
    async def open_run(name: str) -> dict[str, Any]:
        """Work on a run of the workspace (one trained before this qatune ui started, say)."""
        project.run = f"{RUNS}/{workspace.run(name).name}"
        return {"run": project.run}

    @app.post("/api/compare")
    async def compare(body: CompareBody) -> dict[str, Any]:
        run = f"{RUNS}/{workspace.run(body.run.removeprefix(f'{RUNS}/')).name}"
        await run_in_threadpool(refuse_remote_code_of_run, workspace, run, f"qatune eval {run} --compare base")
        if body.other != "base":
            other = f"{RUNS}/{workspace.run(body.other.removeprefix(f'{RUNS}/')).name}"
            await run_in_threadpool(refuse_remote_code_of_run, workspace, other, f"qatune eval {run} --compare {other}")
        args, data = await run_in_threadpool(steps.compare_args, workspace, run, body.other, body.sheet)
        project.run = run
        return job_json(jobs.start("compare", args, run, data=data))

    @app.post("/api/try")
    async def load_to_try(body: RunBody) -> dict[str, Any]:
        name = workspace.run(body.run.removeprefix(f"{RUNS}/")).name
        await run_in_threadpool(refuse_remote_code_of_run, workspace, f"{RUNS}/{name}", f"qatune serve {RUNS}/{name}")
        await trying.load(workspace.root / RUNS / name, name)
        project.run = f"{RUNS}/{name}"
        return {"run": f"{RUNS}/{name}", "page": f"{MOUNT}/", "command": f"qatune serve {RUNS}/{name}"}

    @app.post("/api/answer")
    async def answer(body: AnswerBody) -> dict[str, Any]:
        run = f"{RUNS}/{workspace.run(body.run.removeprefix(f'{RUNS}/')).name}"
        workspace.sheet(body.sheet)
        await run_in_threadpool(refuse_remote_code_of_run, workspace, run, f"qatune generate {run} --file sheets/"
                                f"{body.sheet}")
        return job_json(jobs.start("answer", steps.answer_args(run, body.sheet), run, sheet=body.sheet))

    @app.post("/api/export")
    async def export(body: ExportBody) -> dict[str, Any]:
        run = f"{RUNS}/{workspace.run(body.run.removeprefix(f'{RUNS}/')).name}"
        await run_in_threadpool(refuse_remote_code_of_run, workspace, run, f"qatune export {run} --gguf OUT.gguf")
        args, gguf = steps.export_args(workspace, run, body.quant)
        return job_json(jobs.start("export", args, run, gguf=gguf))

    @app.get("/api/files/{path:path}")
    async def download(path: str) -> FileResponse:
        found = workspace.existing(path, "file")
        if not found.is_file() or workspace.relative(found).split("/")[0] not in DOWNLOADABLE:
            raise PageError(f"{path}: the page downloads files of {', '.join(DOWNLOADABLE)} only", 404)
        return FileResponse(found, filename=found.name)

    @app.get("/api/runs/{name}/final")
    async def final_sizes(name: str) -> dict[str, Any]:
        """The bytes of final/ as a zip, its weights as trained (fp32) and in bf16."""
        return await run_in_threadpool(steps.final_sizes, workspace.run(name))

    @app.get("/api/runs/{name}/final.zip")
    async def final_zip(name: str, dtype: str = "bf16") -> FileResponse:
        run_dir = workspace.run(name)
        if dtype not in steps.ZIP_DTYPES:
            raise PageError(f"dtype {dtype!r}: choose {' or '.join(steps.ZIP_DTYPES)}")
        folder = Path(tempfile.mkdtemp(prefix="zip-", dir=workspace.folder(LOGS)))
        try:
            archive = await run_in_threadpool(steps.zip_final, run_dir, folder / f"{name}-final.zip", dtype)
        except Exception:
            _remove(folder)
            raise
        return FileResponse(archive, filename=archive.name, media_type="application/zip",
                            background=BackgroundTask(_remove, folder))

    def job_json(job: Job | None, with_result: bool = False) -> dict[str, Any] | None:
        if job is None:
            return None
        found = job.as_json()
        if job.kind == "check":
            found["result"] = steps.check_result(job)
        elif job.kind == "compare":
            found["result"] = steps.compare_result(workspace, job) if with_result else None
            found["data"] = job.extra["data"]
        elif job.kind == "answer":
            found["result"] = steps.answer_result(workspace, job)
        elif job.kind == "export":
            found["result"] = steps.export_result(workspace, job)
        return found

    return app


def _static(name: str) -> str:
    return resources.files("qatune.ui").joinpath(f"static/{name}").read_text(encoding="utf-8")


def _remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _add_error_handlers(app: FastAPI) -> None:
    def answer(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message}}, status_code=status)

    @app.exception_handler(QatuneError)
    async def qatune_error(_request: Request, exc: QatuneError) -> JSONResponse:
        return answer(getattr(exc, "status", 400), str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = dict(next(iter(exc.errors()), {}))
        where = ".".join(str(p) for p in first.get("loc", ()) if p not in ("body", "query"))
        return answer(400, f"{where}: {first.get('msg', 'invalid request')}" if where else "invalid request")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return answer(404, f"no route {request.method} {request.url.path}")
        if exc.status_code == 405:
            return answer(405, f"{request.method} is not allowed on {request.url.path}")
        return answer(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.error("internal error: %s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
        return answer(500, "internal error in qatune ui (its log has the details)")
