"""What ``qatune serve`` does for a request: a :class:`Service` holds one loaded run, turns requests into the
Batcher's jobs (prompt, passage, grounding, limits checked) and the jobs' events into OpenAI-shaped responses,
and describes the run for the page; :class:`Settings` and :class:`Limits` are what the command line sets.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

from qatune.data.generative import PromptEncoder, Seq2SeqEncoder
from qatune.data.templates import PromptTemplate
from qatune.errors import ConfigError
from qatune.inference.generate import prompt_budget, run_answer_template, uses_context
from qatune.inference.grounding import (
    AllowedAnswers,
    allowed_answers,
    can_ground,
    grounded,
    no_answer_text,
    with_grounding,
)
from qatune.inference.metric_records import columns
from qatune.inference.run_model import model_id
from qatune.kinds import kind_of
from qatune.model.folder import LoadedModel
from qatune.model.sources import model_max_positions
from qatune.runs.layout import read_status
from qatune.serve.batching import Batcher, Delta, Extraction, Failed, Generation, Job, Whole
from qatune.serve.decoding import Sampling
from qatune.serve.replies import Reply, SlotStreamingResponse
from qatune.serve.request_checks import Gate
from qatune.serve.schemas import AnswerRequest, ApiError, ChatRequest, CompletionRequest, ExtractRequest
from qatune.tasks import TaskKind, task_kind

log = logging.getLogger("qatune")

SHOWN_METRICS = ("exact_match", "f1", "loss", "perplexity")
"""The metrics the page shows of each evaluation of the model, with their records' labels and digits."""

CHARS_PER_TOKEN = 16
"""Prompts longer than this many characters per allowed token are refused without tokenizing them."""


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; everything above is a 4xx answer."""

    max_body_bytes: int = 1_000_000
    max_prompt_tokens: int = 4096
    """Prompt tokens read; a prompt within this limit that leaves a causal LM too few positions for max_tokens
    has its context, then its question, cut as ``qatune generate`` cuts them."""
    max_tokens: int = 1024
    max_concurrent: int = 64
    """Requests in flight (queued or decoding); more get 429."""


@dataclass(frozen=True)
class Settings:
    api_key: str | None = None
    limits: Limits = Limits()
    max_batch_size: int = 32
    """1 turns batching off."""
    batch_wait_ms: float = 5.0
    """How long the first request of a batch waits for others."""
    host: str = "127.0.0.1"
    """The address listened on, and the port: the names the server answers to (guard.py)."""
    port: int = 0
    allowed_hosts: tuple[str, ...] = ()
    """Names it answers to besides the loopback ones and its address (``--allowed-host``: a reverse proxy's)."""


def how_to_send_fields(names: list[str]) -> str:
    example = json.dumps(dict.fromkeys(names, "..."), ensure_ascii=False)
    return f'send them in the request body as "fields": {example} (openai client: extra_body={{"fields": {{...}}}})'


class Service:
    """One loaded run behind the API: turns requests into jobs and the jobs' events into responses."""

    def __init__(self, loaded: LoadedModel, settings: Settings):
        self.loaded = loaded
        self.info = loaded.info
        self.limits = settings.limits
        self.settings = settings
        if loaded.folder.is_file():  # a .gguf file: its results lie beside it, named after it
            self.run_dir, self.model_id = loaded.folder.parent, loaded.folder.stem
            self.results_prefix = f"eval-{loaded.folder.stem}-"
        else:
            self.run_dir = loaded.folder.parent if (loaded.folder.parent / "run.json").is_file() else loaded.folder
            self.model_id, self.results_prefix = self.run_dir.name, "eval-"
        self.created = int(loaded.folder.stat().st_mtime)
        self.batcher = Batcher(loaded, settings.max_batch_size, settings.batch_wait_ms)
        self.gate = Gate(settings.limits.max_concurrent)
        self.template = PromptTemplate(self.info.prompt_template, self.info.answer_prefix)
        self.answer_template = run_answer_template(self.info)  # a grading run's: its answers are parsed back
        if self.kind.writes:
            encoder = Seq2SeqEncoder if self.info.seq2seq else PromptEncoder
            self.encoder = encoder(loaded.tokenizer, self.template)
        self.positions = None if self.info.seq2seq else model_max_positions(loaded.model.config, loaded.tokenizer)

    # --- requests -> jobs

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_id:
            raise ApiError(404, f"model '{name}' does not exist; this server serves '{self.model_id}' "
                           "(see GET /v1/models)", param="model", code="model_not_found")

    def passage(self, body: CompletionRequest | ChatRequest | AnswerRequest, system: str | None) -> str | None:
        """The context: the request's ``context``, else (chat) its system message. A run that reads none
        refuses a ``context`` and ignores a system message (chat clients send one of their own)."""
        if not self.uses_context:
            if body.context is not None:
                raise ApiError(400, "this run's prompt has no {context}: it answers from the question alone; "
                               "leave 'context' out", param="context", code="unexpected_context")
            return None
        context = body.context if body.context is not None else system
        if context is None or not context.strip():
            what = ("this run does extractive QA: the answer is a span of a context" if self.kind.points
                    else "this run's prompt uses a context ({context})")
            raise ApiError(400, f"{what}; pass the passage as 'context' (or, in a chat, as the system message)",
                           param="context", code="missing_context")
        return context

    def prompt_fields(self, given: dict[str, str] | None) -> dict[str, str]:
        """The request's values of the other columns the prompt names, by the prompt's names."""
        template = PromptTemplate("") if self.kind.points else self.template
        values, unknown, missing = template.match_fields(given or {})
        if unknown:
            uses = f"it uses {template.fields}" if template.fields else "it uses no column besides the question"
            raise ApiError(400, f"'fields' names {unknown}, which the run's prompt does not use; {uses}",
                           param="fields", code="unknown_field")
        if missing:
            raise ApiError(400, f"the run's prompt needs the column(s) {missing} besides the question; "
                           f"{how_to_send_fields(missing)}", param="fields", code="missing_fields")
        return values

    def requested_tokens(self, body: CompletionRequest | ChatRequest | AnswerRequest) -> int | None:
        """max_tokens (or max_completion_tokens) as sent, within this server's limit."""
        requested = body.max_tokens or getattr(body, "max_completion_tokens", None)
        if requested is not None and requested > self.limits.max_tokens:
            raise ApiError(400, f"max_tokens={requested} is more than this server allows ({self.limits.max_tokens})",
                           param="max_tokens", code="max_tokens_too_large")
        return requested

    def generation(self, body: CompletionRequest | ChatRequest | AnswerRequest, question: str, context: str | None,
                   fields: dict[str, str], param: str) -> Generation:
        """The prompt's token ids, built by the run's encoder exactly as in training and cut as
        ``qatune generate`` cuts them to fit the model, and the sampling settings. ``param``: the request's
        field that holds the prompt (named by errors)."""
        defaults = self.loaded.config.generate
        requested = self.requested_tokens(body)
        if requested is not None and self.positions and not self.info.seq2seq and requested >= self.positions:
            raise ApiError(400, f"max_tokens={requested} is not less than the model's {self.positions} positions "
                           "(the prompt needs some of them); send a lower max_tokens", param="max_tokens",
                           code="context_length_exceeded")
        self._check_prompt_chars(len(question) + len(context or "") + sum(map(len, fields.values())), param)
        prompt = self.encoder.prompt_ids(question, context, None, fields=fields)
        self._check_prompt_length(len(prompt), param)
        answer_tokens = requested or min(defaults.max_new_tokens, self.limits.max_tokens)
        # the encoder of a seq2seq model reads at most the training max_length
        budget = self.info.max_length if self.info.seq2seq else prompt_budget(self.positions, answer_tokens)
        if budget is not None and len(prompt) > budget:
            prompt = self.encoder.prompt_ids(question, context, budget, fields=fields)
            if prompt is None:
                raise ApiError(400, self._no_room(budget, answer_tokens, requested), param=param,
                               code="context_length_exceeded")
        room = self.limits.max_tokens
        if self.positions:
            room = min(room, self.positions - len(prompt))
            if requested is not None and requested > room:
                raise ApiError(400, f"max_tokens={requested} leaves {self.positions - requested} of the model's "
                               f"{self.positions} positions for the prompt, which needs {len(prompt)} even with the "
                               f"question cut; lower max_tokens to at most {room}", param="max_tokens",
                               code="context_length_exceeded")
        sampling = Sampling(
            max_tokens=requested or min(defaults.max_new_tokens, room),
            temperature=body.temperature if body.temperature is not None else defaults.temperature,
            top_p=body.top_p if body.top_p is not None else defaults.top_p,
            stop=body.stops, seed=body.seed,
        )
        return Generation(prompt, sampling, self.spans(body, context, sampling.max_tokens))

    def spans(self, body: CompletionRequest | ChatRequest | AnswerRequest, context: str | None,
              max_tokens: int) -> AllowedAnswers | None:
        """The answers the passage allows when the request's ``grounded`` (or the run's generate.grounded) turns
        grounded decoding on; None otherwise."""
        if not self.grounds(body.grounded):
            return None
        prefix = "" if self.info.seq2seq else self.info.answer_prefix
        return allowed_answers(self.loaded.tokenizer, [context], prefix, self.encoder.stop_ids, max_tokens,
                               no_answer_text(self.info))[0]

    def grounds(self, setting: str | None) -> bool:
        """Whether a request with ``grounded: setting`` is answered with a span of its passage."""
        try:
            return grounded(self.info, with_grounding(self.loaded.config.generate, setting))
        except ConfigError as exc:
            raise ApiError(400, str(exc).replace("generate.grounded on", "'grounded': 'on'"), param="grounded",
                           code="unsupported_parameter") from None

    def _no_room(self, budget: int, answer_tokens: int, requested: int | None) -> str:
        if self.info.seq2seq:
            return f"the run's prompt template alone is longer than the {budget} tokens its encoder reads (max_length)"
        why = (f"max_tokens={requested}" if requested
               else f"the run's {answer_tokens} answer tokens (generate.max_new_tokens)")
        return (f"the run's prompt template alone is longer than the {budget} of the model's {self.positions} "
                f"positions left for the prompt after {why}; send a lower max_tokens")

    def extraction(self, question: str, context: str | None, max_answer_length: int | None,
                   context_param: str = "context", param: str = "context") -> tuple[Extraction, int]:
        if not context or not context.strip():
            raise ApiError(400, "this run does extractive QA: the answer is a span of a context; pass the passage as "
                           "'context' (or, in a chat, as the system message)", param=context_param,
                           code="missing_context")
        self._check_prompt_chars(len(question) + len(context), param)
        tokenizer = self.loaded.tokenizer
        tokens = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in (question, context))
        self._check_prompt_length(tokens, param)
        longest = max_answer_length or self.loaded.config.generate.max_answer_length
        return Extraction(question, context, longest), tokens

    def whole(self, question: str, context: str | None, fields: dict[str, str], param: str) -> tuple[Whole, int]:
        text = self.template.render(question, context, fields)
        self._check_prompt_chars(len(text), param)
        tokens = len(self.loaded.tokenizer(text)["input_ids"])
        self._check_prompt_length(tokens, param)
        return Whole(question, context, fields, tokens), tokens

    def _check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse what is surely too long before tokenizing it (tokenizing 1 MB takes a second, on the event loop)."""
        limit = CHARS_PER_TOKEN * self.limits.max_prompt_tokens
        if chars > limit:
            raise ApiError(400, f"the prompt has {chars} characters, more than this server reads ({limit}: "
                           f"{CHARS_PER_TOKEN} per token of --max-prompt-tokens)", param=param,
                           code="context_length_exceeded")

    def _check_prompt_length(self, tokens: int, param: str) -> None:
        if tokens > self.limits.max_prompt_tokens:
            raise ApiError(400, f"the prompt has {tokens} tokens, more than this server allows "
                           f"({self.limits.max_prompt_tokens})", param=param, code="context_length_exceeded")

    # --- jobs -> responses

    async def complete(self, body: CompletionRequest | ChatRequest, question: str, chat: bool,
                       system: str | None = None) -> Any:
        self.check_model(body.model)
        body.check_supported()
        if not question.strip():
            raise ApiError(400, "the question is empty", param="messages" if chat else "prompt", code="empty_question")
        request, prompt_tokens = self.job(body, question, system, "messages" if chat else "prompt")
        reply = Reply(self.model_id, chat, prompt_tokens, self.loaded.tokenizer)
        slot = self.gate.enter()
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return SlotStreamingResponse(reply.stream(self.events(request, stream=True), usage), slot,
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            return await reply.collect(self.events(request, stream=False))
        finally:
            slot.release()

    def job(self, body: CompletionRequest | ChatRequest | AnswerRequest, question: str, system: str | None,
            param: str) -> tuple[Generation | Extraction, int]:
        """The job of a question and its prompt's token count (``param``: the request's field that holds the
        question, named by errors)."""
        context = self.passage(body, system)
        fields = self.prompt_fields(body.fields)
        if self.kind.points:
            # max_tokens bounds the span, in the run's tokens, as it bounds a generated answer
            return self.extraction(question, context, self.requested_tokens(body), param=param)
        if kind_of(self.info.task).answers_whole:
            return self.whole(question, context, fields, param)
        request = self.generation(body, question, context, fields, param)
        return request, len(request.prompt)

    async def answer(self, body: AnswerRequest) -> dict[str, Any]:
        """POST /v1/answer: the answer as one JSON object (:meth:`Reply.answer`), a grading run's parsed."""
        self.check_model(body.model)
        body.check_supported()
        if body.stream:
            raise ApiError(400, "/v1/answer answers in one piece; to stream, ask POST /v1/chat/completions or "
                           "/v1/completions", param="stream", code="unsupported_parameter")
        if not body.question.strip():
            raise ApiError(400, "the question is empty", param="question", code="empty_question")
        request, prompt_tokens = self.job(body, body.question, None, "question")
        slot = self.gate.enter()
        try:
            reply = Reply(self.model_id, False, prompt_tokens, self.loaded.tokenizer)
            answer = await reply.answer(self.events(request, stream=False), self.answer_template)
        finally:
            slot.release()
        if isinstance(request, Generation) and can_ground(self.info):
            answer["grounded"] = request.spans is not None  # whether the answer was held to spans of the passage
        return answer

    async def extract(self, body: ExtractRequest) -> dict[str, Any]:
        self.check_model(body.model)
        body.check_supported()
        if not self.kind.points:
            raise ApiError(400, "this run is generative: ask it with POST /v1/chat/completions or /v1/completions",
                           code="unsupported_task")
        if not body.question.strip():
            raise ApiError(400, "the question is empty", param="question", code="empty_question")
        request, prompt_tokens = self.extraction(body.question, body.context, body.max_answer_length)
        slot = self.gate.enter()
        try:
            async for event in self.events(request, stream=False):
                if isinstance(event, Failed):
                    raise ApiError(500, event.message, code="model_failed", kind="server_error")
                return {"model": self.model_id, "answer": event.answer, "score": event.score,
                        "start": event.start, "end": event.end, "usage": {"prompt_tokens": prompt_tokens}}
        finally:
            slot.release()
        raise ApiError(500, "the model gave no answer", kind="server_error")

    async def events(self, request: Generation | Extraction, stream: bool) -> AsyncIterator[Any]:
        """The job's events, as the worker thread produces them; leaving early cancels the job."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[Any] = asyncio.Queue()

        def notify(event: Any) -> None:
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                job.cancelled = True

        job = Job(request, notify, stream)
        self.batcher.submit(job)
        try:
            while True:
                event = await inbox.get()
                yield event
                if not isinstance(event, Delta):
                    return
        finally:
            job.cancelled = True

    # --- run information

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "qatune"}

    def summary(self) -> dict[str, Any]:
        """What the page shows: task, base model, evaluation metrics from run.json and eval-*.json."""
        status = read_status(self.run_dir)
        result = status.get("result") or {}
        evaluations = {}
        served = model_id(self.loaded)
        for path in sorted(self.run_dir.glob(f"{self.results_prefix}*.json")):
            try:
                metrics = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            # Results of another model folder, or of this one before it was written again (a resumed run), are
            # not this model's.
            if isinstance(metrics, dict) and metrics.get("model_id", served) == served:
                evaluations[path.stem.removeprefix(self.results_prefix)] = metrics
        return {
            "id": self.model_id, "task": self.info.task, "kind": self.model_kind, "answer": self.kind.answer,
            "base_model": self.base_model,
            "prompt_template": self.info.prompt_template, "uses_context": self.uses_context,
            "fields": self.field_names, "answer_fields": self.info.answer_fields,
            "status": status.get("status"), "best_eval": result.get("best_eval"),
            "final_train_loss": result.get("final_train_loss"), "steps": result.get("steps"),
            "evaluations": evaluations, "metric_columns": columns(SHOWN_METRICS),
            "loss_curve": "/run/loss.png" if (self.run_dir / "loss.png").is_file() else None,
            "limits": asdict(self.limits), "max_batch_size": self.settings.max_batch_size,
            "max_tokens_default": self.loaded.config.generate.max_new_tokens,
            "grounding": self.grounding_summary(),
        }

    def grounding_summary(self) -> dict[str, Any] | None:
        """Whether the run can answer with spans of the passage, whether it does unless a request says otherwise,
        and what its training answers showed (None for a run that cannot be grounded)."""
        if not can_ground(self.info):
            return None
        return {"default": self.grounds(None), "setting": self.loaded.config.generate.grounded,
                "training": self.info.grounding}

    @property
    def uses_context(self) -> bool:
        return uses_context(self.info)

    @property
    def field_names(self) -> list[str]:
        """Columns the run's prompt names besides the question and the context."""
        return [] if self.kind.points else self.template.fields

    def request_needs(self) -> list[str]:
        """What a request must send besides the question, one line each (logged when the server starts)."""
        lines = []
        if self.uses_context:
            lines.append("this run reads a context: send the passage as 'context' (or, in a chat, as the system "
                         "message)")
        if self.field_names:
            lines.append(f"this run's prompt needs the column(s) {self.field_names} besides the question: "
                         f"{how_to_send_fields(self.field_names)}")
        return lines

    @property
    def kind(self) -> TaskKind:
        return task_kind(self.info.task)

    @property
    def model_kind(self) -> str:
        """What the run is, as the summary and the start line say it: causal, seq2seq, extractive or scoring."""
        found = ("seq2seq" if self.info.seq2seq else "causal") if self.kind.writes else self.info.task
        return f"{found} + LoRA" if self.info.lora_base else found

    @property
    def base_model(self) -> str:
        model = self.loaded.config.model
        architecture = type(self.loaded.model).__name__
        if model.scratch is not None:
            return f"{architecture} from scratch ({model.scratch.n_layer} layers × {model.scratch.n_embd})"
        return f"{model.name_or_path} ({architecture})"
