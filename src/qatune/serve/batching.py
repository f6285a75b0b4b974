"""The model's worker: requests wait in a queue, are taken in batches and answered together.

One thread owns the model. The worker takes the first waiting job, waits a few milliseconds for more
(up to ``max_batch_size``) and answers them in one batch. Generative batches are decoded token by
token with a KV cache: left-padded prompts whose position ids count from each row's first real token,
per-row sampling, per-row stops (EOS, stop strings, max_tokens), and each row's text pushed to its
request as soon as it is final. Rows that finish leave the batch; with a causal LM, requests that
arrive meanwhile join it between two steps (their prompts are encoded on their own, then their KV
cache is left-padded and stacked onto the running one), so nobody waits for a whole batch to end.
At temperature 0 a row gets the tokens ``model.generate`` gives it alone, so an answer does not
depend on what it was batched with.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qatune.data.extractive import best_span_offsets, prepare_features
from qatune.data.padding import left_pad, right_pad
from qatune.data.spreadsheet import QARecord
from qatune.generate import score_windows
from qatune.model_folder import LoadedModel

log = logging.getLogger("qatune")


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Generation:
    """A generative request: the prompt's token ids (built by the run's PromptEncoder) and how to sample."""

    prompt: list[int]
    sampling: Sampling


@dataclass(frozen=True)
class Extraction:
    """An extractive request: the span of ``context`` that answers ``question``."""

    question: str
    context: str
    max_answer_length: int


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

    request: Generation | Extraction
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
        if info.task == "generative":
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
                if self.loaded.info.task == "extractive":
                    self._extract(jobs)
                else:
                    more = self._more if self.max_batch_size > 1 else None
                    self._decoder.run([_Row(job, self.loaded.tokenizer) for job in jobs], more)
        except Exception as exc:  # a failed batch fails its requests, never the server
            log.error("a batch of %d requests failed: %s: %s", len(self._current), type(exc).__name__, exc,
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


class AnswerText:
    """A row's tokens as the answer text ``qatune generate`` prints, released as soon as it is final.

    The answer is the decoded tokens before EOS (or before a stop string), stripped. Held back until
    more tokens arrive: trailing whitespace, an incomplete UTF-8 character, and a tail that may be the
    start of a stop string. The released pieces add up to the final text.
    """

    def __init__(self, tokenizer: Any, max_tokens: int, stop: tuple[str, ...] = (), incremental: bool = True):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.max_tokens = max_tokens
        self.stop = tuple(s for s in stop if s)
        self.incremental = incremental or bool(self.stop)
        """Decode after every token (to stream, or to see stop strings); else only at the end."""
        self.tokens: list[int] = []
        self.generated = 0
        self.sent = 0
        self.text = ""
        self.finish_reason: str | None = None

    def push(self, token: int) -> str:
        """Add one generated token; returns the text that became final (maybe empty)."""
        self.generated += 1
        if token == self.eos_id:
            return self._finish("stop", self._decode())
        self.tokens.append(token)
        if not self.incremental:
            return self._finish("length", self._decode()) if self.generated >= self.max_tokens else ""
        text = self._decode()
        cuts = [i for i in (text.find(s) for s in self.stop) if i != -1]
        if cuts:
            return self._finish("stop", text[: min(cuts)])
        if self.generated >= self.max_tokens:
            return self._finish("length", text)
        end = len(text.rstrip().rstrip("\ufffd"))
        hold = max((k for s in self.stop for k in range(1, min(len(s), end + 1)) if text[:end].endswith(s[:k])),
                   default=0)
        return self._release(text, end - hold)

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True).lstrip()

    def _finish(self, reason: str, text: str) -> str:
        self.finish_reason = reason
        self.text = text.strip()
        return self._release(self.text, len(self.text))

    def _release(self, text: str, end: int) -> str:
        piece = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece


class _Row:
    """One job in a generative batch: its text, its random generator, its events."""

    def __init__(self, job: Job, tokenizer: Any):
        self.job = job
        self.request: Generation = job.request
        sampling = self.request.sampling
        self.answer = AnswerText(tokenizer, sampling.max_tokens, sampling.stop, incremental=job.stream)
        self.generator = None
        if sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling.seed)

    @property
    def finished(self) -> bool:
        return self.answer.finish_reason is not None or self.job.cancelled

    def push(self, token: int) -> None:
        piece = self.answer.push(token)
        if piece and self.job.stream:
            self.job.notify(Delta(piece))
        if self.answer.finish_reason is not None:
            self.job.done = True
            self.job.notify(Finished(self.answer.text, self.answer.finish_reason, len(self.request.prompt),
                                     self.answer.generated))


class Decoder:
    """Token-by-token decoding of a batch of rows, causal LM or encoder-decoder, with a KV cache."""

    def __init__(self, model: Any, tokenizer: Any, seq2seq: bool):
        self.model = model
        self.pad_id = tokenizer.pad_token_id
        self.seq2seq = seq2seq
        parameters = inspect.signature(model.forward).parameters
        self.cache_name = "cache" if "cache" in parameters else "past_key_values"  # renamed in transformers 5
        self.extra: dict[str, Any] = {}
        if not seq2seq and "logits_to_keep" in parameters:
            self.extra["logits_to_keep"] = 1  # as model.generate does: same numbers, less work
        self.with_positions = not seq2seq and "position_ids" in parameters

    def run(self, rows: list[_Row], more: Callable[[int], list[_Row]] | None = None) -> None:
        """Decode until every row has finished; each row receives its tokens through ``push``.

        ``more(active)`` is asked after every step for rows that join the batch (causal LMs only).
        """
        steps = self._steps()
        logits = steps.start([row.request.prompt for row in rows])
        joinable = more is not None and steps.joinable
        while rows:
            tokens = choose_tokens(logits, [row.request.sampling for row in rows], [row.generator for row in rows])
            for row, token in zip(rows, tokens.tolist()):
                row.push(token)
            keep = [i for i, row in enumerate(rows) if not row.finished]
            if len(keep) < len(rows):
                rows, tokens = [rows[i] for i in keep], tokens[keep]
                if rows:
                    steps.select(torch.tensor(keep, device=tokens.device))
            joining = more(len(rows)) if joinable else []
            if rows:
                logits = steps.next(tokens)
            if joining and rows:
                logits = torch.cat([logits, steps.join([row.request.prompt for row in joining])])
            elif joining:
                steps = self._steps()
                logits = steps.start([row.request.prompt for row in joining])
            rows += joining

    def _steps(self) -> _CausalSteps | _EncoderDecoderSteps:
        return _EncoderDecoderSteps(self) if self.seq2seq else _CausalSteps(self)

    def forward(self, **inputs: Any) -> torch.Tensor:
        out = self.model(**inputs, use_cache=True, **self.extra)
        return out.logits[:, -1, :].float()


class _CausalSteps:
    """Left-padded prompts; position ids count from each row's first real token, as model.generate does."""

    def __init__(self, decoder: Decoder):
        from transformers import DynamicCache

        self.decoder = decoder
        model = decoder.model
        self.device = next(model.parameters()).device
        self.cache = DynamicCache(config=model.config.get_text_config(decoder=True))

    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        input_ids, mask = left_pad(prompts, self.decoder.pad_id)
        self.mask = mask.to(self.device)
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(input_ids.to(self.device))
        self.joinable = self._can_join()
        return logits

    def next(self, tokens: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(tokens), 1))], dim=1)
        self.positions = self.positions[:, -1:] + 1
        return self._forward(tokens[:, None])

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.mask, self.positions = self.mask[keep], self.positions[keep]
        if self.joinable:
            # columns that are padding for every row left: without this a batch that keeps being
            # joined would grow wider with every step
            first = int(self.mask.any(dim=0).int().argmax())
            if first > 0:
                self.mask = self.mask[:, first:]
                for layer in self.cache.layers:
                    layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]

    def _can_join(self) -> bool:
        """Rows can join when every cache layer is a plain growing tensor (not a sliding window, not quantized)."""
        from transformers.cache_utils import DynamicLayer

        kinds = {type(layer) for layer in self.cache.layers}
        if kinds == {DynamicLayer}:
            return True
        log.debug("serve: requests wait for the running batch to end (cache layers %s cannot be joined)",
                  sorted(kind.__name__ for kind in kinds))
        return False

    def join(self, prompts: list[list[int]]) -> torch.Tensor:
        """Encode new prompts on their own, then stack their cache below the running one; their logits."""
        other = _CausalSteps(self.decoder)
        logits = other.start(prompts)
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_pad_left(mine.keys, width, -2), _pad_left(theirs.keys, width, -2)])
            mine.values = torch.cat([_pad_left(mine.values, width, -2), _pad_left(theirs.values, width, -2)])
        self.mask = torch.cat([_pad_left(self.mask, width, -1), _pad_left(other.mask, width, -1)])
        self.positions = torch.cat([self.positions[:, -1:], other.positions[:, -1:]])
        return logits

    def _forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        inputs = {"input_ids": input_ids, "attention_mask": self.mask, self.decoder.cache_name: self.cache}
        if self.decoder.with_positions:
            inputs["position_ids"] = self.positions
        return self.decoder.forward(**inputs)


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zeros on the left of ``dim`` up to ``width`` (cache entries and mask columns nobody attends to)."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad = [0, 0] * (-dim - 1) + [missing, 0]
    return torch.nn.functional.pad(tensor, pad)


class _EncoderDecoderSteps:
    """The encoder reads the right-padded prompts once; the decoder starts from decoder_start_token_id.
    Rows do not join a running encoder-decoder batch (its encoder outputs have one width)."""

    joinable = False

    def __init__(self, decoder: Decoder):
        from transformers import DynamicCache, EncoderDecoderCache

        self.decoder = decoder
        model = decoder.model
        self.device = next(model.parameters()).device
        config = model.config.get_text_config(decoder=True)
        self.cache = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))

    def start(self, prompts: list[list[int]]) -> torch.Tensor:
        input_ids, mask = right_pad(prompts, self.decoder.pad_id)
        self.mask = mask.to(self.device)
        self.encoded = self.decoder.model.get_encoder()(input_ids=input_ids.to(self.device), attention_mask=self.mask)
        start = self.decoder.model.config.decoder_start_token_id
        return self._forward(torch.full((len(prompts), 1), start, dtype=torch.long, device=self.device))

    def next(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._forward(tokens[:, None])

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.mask = self.mask[keep]
        self.encoded["last_hidden_state"] = self.encoded["last_hidden_state"][keep]

    def _forward(self, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.forward(encoder_outputs=self.encoded, attention_mask=self.mask,
                                    decoder_input_ids=decoder_input_ids, **{self.decoder.cache_name: self.cache})


def choose_tokens(logits: torch.Tensor, sampling: list[Sampling], generators: list[Any]) -> torch.Tensor:
    """Greedy rows take the argmax; the others sample with their temperature, top_p and generator."""
    tokens = logits.argmax(dim=-1)
    for i, (settings, generator) in enumerate(zip(sampling, generators)):
        if settings.temperature > 0:
            tokens[i] = sample(logits[i], settings.temperature, settings.top_p, generator)
    return tokens


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: Any = None) -> int:
    """One token from softmax(logits / temperature), keeping the smallest set of tokens whose mass reaches top_p."""
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        ordered[(ordered.cumsum(-1) - ordered) >= top_p] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, ordered)
    return int(torch.multinomial(probs, 1, generator=generator))

