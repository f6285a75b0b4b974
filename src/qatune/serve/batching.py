"""The model's worker: requests wait in a queue, are taken in batches and answered together.

One thread owns the model. The worker takes the first waiting job, waits a few milliseconds for more
(up to ``max_batch_size``) and answers them in one batch: extractive ones in one pass over their
contexts, generative ones token by token (:mod:`qatune.serve.decoding`), each row's text pushed to its
request as soon as it is final. With a causal LM, requests that arrive while a batch is decoded join it
between two steps, so nobody waits for a whole batch to end. At temperature 0 a row gets the tokens
``model.generate`` gives it alone, so an answer does not depend on what it was batched with.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qatune.data.extractive import best_span_offsets, prepare_features
from qatune.data.spreadsheet import QARecord
from qatune.inference.generate import score_windows
from qatune.inference.grounding import AllowedAnswers
from qatune.kinds import kind_of
from qatune.model.folder import LoadedModel
from qatune.serve.decoding import AnswerText, Decoder, Sampling

log = logging.getLogger("qatune")


@dataclass(frozen=True)
class Generation:
    """A generative request: the prompt's token ids (built by the run's PromptEncoder) and how to sample."""

    prompt: list[int]
    sampling: Sampling
    spans: AllowedAnswers | None = None
    """Grounded decoding: the answers the passage allows (None: any answer)."""


@dataclass(frozen=True)
class Extraction:
    """An extractive request: the span of ``context`` that answers ``question``."""

    question: str
    context: str
    max_answer_length: int


@dataclass(frozen=True)
class Whole:
    """A request whose answer the run's kind gives whole (a scoring run's heads, a multiple-choice run's choice):
    a row (its question, passage and other columns)."""

    question: str
    context: str | None
    fields: dict[str, str]
    prompt_tokens: int


# Events a job receives, in order: Delta* then Finished, or Extracted, or Failed.
@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Finished:
    text: str
    finish_reason: str
    """"stop" (EOS or a stop string) or "length" (max_tokens)."""
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Extracted:
    answer: str
    score: float | None
    """Start logit + end logit of the span (None when the context has no valid span)."""
    start: int
    end: int
    """Character span [start, end) of the answer in the context."""


@dataclass(frozen=True)
class Failed:
    message: str


@dataclass(eq=False)
class Job:
    """One request. ``notify`` receives its events on the worker thread and must not block."""

    request: Generation | Extraction | Whole
    notify: Callable[[Any], None]
    stream: bool = True
    """Send each piece of text as it is final (Delta events); else only the Finished event."""
    cancelled: bool = False
    """Set by the request's side when its client went away: the worker drops the row."""
    done: bool = False


@dataclass
class BatchStats:
    batches: int = 0
    jobs: int = 0
    joined: int = 0
    """Jobs that joined a batch already being decoded."""
    largest: int = 0
    """Most rows decoded together."""


_STOP = object()


class Batcher:
    """Runs every job of one loaded run on a single worker thread, in batches."""

    def __init__(self, loaded: LoadedModel, max_batch_size: int = 32, wait_ms: float = 5.0):
        self.loaded = loaded
        self.max_batch_size = max(1, max_batch_size)
        self.wait_s = wait_ms / 1000 if self.max_batch_size > 1 else 0.0
        self.stats = BatchStats()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._current: list[Job] = []
        self._stopping = False
        info = loaded.info
        self.kind = kind_of(info.task)
        if not (self.kind.record.points or self.kind.answers_whole):
            self._decoder = Decoder(loaded.model, loaded.tokenizer, info.seq2seq)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="qatune-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish the jobs already queued, then end the worker."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None

    def submit(self, job: Job) -> None:
        self._queue.put(job)

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def _work(self) -> None:
        while not self._stopping:
            jobs = self._take()
            if jobs:
                self.stats.batches += 1
                self.stats.jobs += len(jobs)
                self.stats.largest = max(self.stats.largest, len(jobs))
                self._answer(jobs)

    def _take(self) -> list[Job]:
        """The first waiting job, and those that arrive within the wait (up to a full batch)."""
        jobs = [self._queue.get()]
        deadline = time.monotonic() + self.wait_s
        while len(jobs) < self.max_batch_size and jobs[-1] is not _STOP:
            try:
                jobs.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return self._live(jobs)

    def _more(self, active: int) -> list[_Row]:
        """Rows for the jobs waiting now, up to a full batch: they join the batch being decoded."""
        jobs = []
        while active + len(jobs) < self.max_batch_size and not self._stopping:
            try:
                jobs.append(self._queue.get_nowait())
            except queue.Empty:
                break
        jobs = self._live(jobs)
        self._current = [job for job in self._current if not job.done] + jobs  # a batch may never end
        self.stats.jobs += len(jobs)
        self.stats.joined += len(jobs)
        self.stats.largest = max(self.stats.largest, active + len(jobs))
        return [_Row(job, self.loaded.tokenizer) for job in jobs]

    def _live(self, jobs: list[Any]) -> list[Job]:
        if _STOP in jobs:
            self._stopping = True
        return [job for job in jobs if job is not _STOP and not job.cancelled]

    def _answer(self, jobs: list[Job]) -> None:
        self._current = jobs
        try:
            with torch.inference_mode():
                if self.kind.record.points:
                    self._extract(jobs)
                elif self.kind.answers_whole:
                    self._whole(jobs)
                else:
                    more = self._more if self.max_batch_size > 1 else None
                    self._decoder.run([_Row(job, self.loaded.tokenizer) for job in jobs], more)
        except Exception as exc:  # a failed batch fails its requests, never the server
            log.error("a batch of %d request(s) failed: %s: %s", len(self._current), type(exc).__name__, exc,
                      exc_info=log.isEnabledFor(logging.DEBUG))
            for job in self._current:
                if not job.done:
                    job.done = True
                    job.notify(Failed(f"the model failed on this batch ({type(exc).__name__})"))

    def _extract(self, jobs: list[Job]) -> None:
        loaded = self.loaded
        records = [QARecord(question=job.request.question, answers=[], context=job.request.context, row=i)
                   for i, job in enumerate(jobs)]
        features, _, _ = prepare_features(loaded.tokenizer, records, loaded.info.max_length, loaded.info.doc_stride,
                                          train=False)
        starts, ends, _, _ = score_windows(loaded.model, loaded.tokenizer, features, batch_size=32)
        windows: dict[int, list[int]] = {}
        for i, feature in enumerate(features):
            windows.setdefault(feature.example, []).append(i)
        for example, job in enumerate(jobs):
            indices = windows.get(example, [])
            start, end, score = best_span_offsets(
                [features[i] for i in indices], [starts[i] for i in indices], [ends[i] for i in indices],
                loaded.config.generate.n_best, job.request.max_answer_length)
            job.done = True
            found = score != float("-inf")
            job.notify(Extracted(answer=job.request.context[start:end] if found else "",
                                 score=score if found else None, start=start, end=end))


    def _whole(self, jobs: list[Job]) -> None:
        """Answers the run's kind gives whole, as ``qatune generate`` gives them."""
        loaded = self.loaded
        requests = [job.request for job in jobs]
        texts = self.kind.answer(loaded.model, loaded.tokenizer, loaded.info, [r.question for r in requests],
                                 [r.context for r in requests], loaded.config.generate, batch_size=32,
                                 fields=[r.fields for r in requests])
        for job, text in zip(jobs, texts):
            job.done = True
            if job.stream:
                job.notify(Delta(text))
            job.notify(Finished(text, "stop", job.request.prompt_tokens, 0))


class _Row:
    """One job in a generative batch: its text, its random generator, its events."""

    def __init__(self, job: Job, tokenizer: Any):
        self.job = job
        self.request: Generation = job.request
        sampling = self.request.sampling
        self.answer = AnswerText(tokenizer, sampling.max_tokens, sampling.stop, incremental=job.stream)
        self.tokens: list[int] = []
        self.generator = None
        if sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling.seed)

    @property
    def finished(self) -> bool:
        return self.answer.finish_reason is not None or self.job.cancelled

    def allowed(self) -> list[int] | None:
        spans = self.request.spans
        return spans.allowed(self.tokens) if spans is not None else None

    def push(self, token: int) -> None:
        self.tokens.append(token)
        piece = self.answer.push(token)
        if piece and self.job.stream:
            self.job.notify(Delta(piece))
        if self.answer.finish_reason is not None:
            self.job.done = True
            self.job.notify(Finished(self.answer.text, self.answer.finish_reason, len(self.request.prompt),
                                     self.answer.generated))
