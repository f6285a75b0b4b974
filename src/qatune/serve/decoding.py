"""Token-by-token decoding of a batch of rows with a KV cache, and the text each row releases.

A causal LM's prompts are left-padded, with position ids that count from each row's first real token (as
``model.generate`` does), so a row's tokens do not depend on the rows beside it; rows that finish leave the
batch, and new rows can join it between two steps (their prompts encoded on their own, their cache
left-padded and stacked onto the running one). An encoder-decoder reads its prompts once and decodes from
``decoder_start_token_id``. :class:`AnswerText` turns a row's tokens into the answer text as it becomes
final (stop strings, EOS, max_tokens).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from qatune.data.padding import left_pad, right_pad
from qatune.inference.grounding import ground_scores
from qatune.model.kv_cache import cache_argument, last_logits_only

log = logging.getLogger("qatune")


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


class Row(Protocol):
    """What the decoder needs of a row: its prompt and sampling, its generator, the tokens it may take next (None:
    any; grounded decoding), where its tokens go."""

    request: Any
    generator: Any

    @property
    def finished(self) -> bool: ...

    def allowed(self) -> list[int] | None: ...

    def push(self, token: int) -> None: ...


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


class Decoder:
    """Token-by-token decoding of a batch of rows, causal LM or encoder-decoder, with a KV cache."""

    def __init__(self, model: Any, tokenizer: Any, seq2seq: bool):
        self.model = model
        self.pad_id = tokenizer.pad_token_id
        self.seq2seq = seq2seq
        self.cache_name = cache_argument(model)
        self.extra: dict[str, Any] = {} if seq2seq else last_logits_only(model)
        self.with_positions = not seq2seq and "position_ids" in inspect.signature(model.forward).parameters

    def run(self, rows: list[Row], more: Callable[[int], list[Row]] | None = None) -> None:
        """Decode until every row has finished; each row receives its tokens through ``push``.

        ``more(active)`` is asked after every step for rows that join the batch (causal LMs only).
        """
        steps = self._steps()
        logits = steps.start([row.request.prompt for row in rows])
        joinable = more is not None and steps.joinable
        while rows:
            logits = ground_scores(logits, [row.allowed() for row in rows])
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
