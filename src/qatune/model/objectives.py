"""Training objectives: a model wrapped so that ``forward(batch)`` returns a summed loss.

The loop divides the sum by the number of supervised items in the whole accumulation window, so
gradient accumulation gives the same update as one large batch. Wrapping the model (instead of
calling its parts from the loop) keeps DDP and mixed-precision hooks on the path of every forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qatune.data.padding import IGNORE_INDEX

_BOOKKEEPING = {"row", "n_items", "n_tokens"}


class CausalLMObjective(nn.Module):
    """Next-token cross-entropy over the supervised positions, through the model's own forward.

    :class:`qatune.speedups.causal.SupervisedRowsObjective` computes the same loss with less work.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                label_weights: torch.Tensor | None = None, **_: Any) -> dict[str, torch.Tensor]:
        targets = labels[:, 1:]
        supervised = targets != IGNORE_INDEX
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1][supervised]
        loss_sum = weighted_cross_entropy(logits, targets, supervised, label_weights)
        return {"loss_sum": loss_sum, "count": supervised.sum(), "logit_absmax": absmax(logits)}


def weighted_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, supervised: torch.Tensor,
                           label_weights: torch.Tensor | None) -> torch.Tensor:
    """The cross-entropy of the supervised targets, summed; each weighed by ``label_weights`` (aligned with the
    labels, whose targets are one position on) where given."""
    if label_weights is None:
        return F.cross_entropy(logits.float(), targets[supervised], reduction="sum")
    losses = F.cross_entropy(logits.float(), targets[supervised], reduction="none")
    return (losses * label_weights[:, 1:][supervised]).sum()


class SpanObjective(nn.Module):
    """Mean of start and end cross-entropy per window; padding positions can never be chosen."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, start_positions: torch.Tensor,
                end_positions: torch.Tensor, token_type_ids: torch.Tensor | None = None, **_: Any
                ) -> dict[str, torch.Tensor]:
        start_logits, end_logits = span_logits(self.model, input_ids, attention_mask, token_type_ids)
        loss_sum = span_loss_sum(start_logits, end_logits, start_positions, end_positions)
        count = (start_positions != IGNORE_INDEX).sum()
        return {"loss_sum": loss_sum, "count": count, "logit_absmax": absmax(start_logits.masked_fill(
            attention_mask == 0, 0.0))}


def span_loss_sum(start_logits: torch.Tensor, end_logits: torch.Tensor, start_positions: torch.Tensor,
                  end_positions: torch.Tensor) -> torch.Tensor:
    """Summed over labelled windows: the mean of the start and end cross-entropies of each window."""
    return 0.5 * (F.cross_entropy(start_logits, start_positions, ignore_index=IGNORE_INDEX, reduction="sum")
                  + F.cross_entropy(end_logits, end_positions, ignore_index=IGNORE_INDEX, reduction="sum"))


class Seq2SeqObjective(nn.Module):
    """Encoder-decoder: cross-entropy of the decoder over the answer tokens (teacher forcing)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor, **_: Any
                ) -> dict[str, torch.Tensor]:
        decoder_input_ids = _shift_right(labels, self.model.config)
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            decoder_input_ids=decoder_input_ids).logits
        supervised = labels != IGNORE_INDEX
        logits = logits[supervised]
        loss_sum = F.cross_entropy(logits.float(), labels[supervised], reduction="sum")
        return {"loss_sum": loss_sum, "count": supervised.sum(), "logit_absmax": absmax(logits)}


def _shift_right(labels: torch.Tensor, config: Any) -> torch.Tensor:
    """Decoder inputs: the start token, then the labels shifted right (padding for -100)."""
    start = config.decoder_start_token_id if config.decoder_start_token_id is not None else config.pad_token_id
    shifted = labels.new_full(labels.shape, config.pad_token_id)
    shifted[:, 1:] = labels[:, :-1].masked_fill(labels[:, :-1] == IGNORE_INDEX, config.pad_token_id)
    shifted[:, 0] = start
    return shifted


def span_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 start/end logits with padding positions pushed to the lowest value."""
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if token_type_ids is not None:
        inputs["token_type_ids"] = token_type_ids
    out = model(**inputs)
    floor = torch.finfo(torch.float32).min
    pad = attention_mask == 0
    return out.start_logits.float().masked_fill(pad, floor), out.end_logits.float().masked_fill(pad, floor)


def is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def count_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Non-padding tokens in a batch."""
    return int(batch["n_tokens"]) if "n_tokens" in batch else int(batch["attention_mask"].sum())


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors an objective takes (drops bookkeeping such as source row numbers)."""
    return {key: value for key, value in batch.items() if key not in _BOOKKEEPING}


def absmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.detach().abs().max() if logits.numel() else torch.zeros((), device=logits.device)
