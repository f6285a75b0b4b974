"""Training objectives: a model wrapped so that ``forward(batch)`` returns a summed loss.

The loop divides the sum by the number of supervised items in the whole accumulation window, so
gradient accumulation gives the same update as one large batch. Wrapping the model (instead of
calling its parts from the loop) keeps DDP and mixed-precision hooks on the path of every forward.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qatune import lean_causal, lean_gpt2, lean_lora
from qatune.data.generative import IGNORE_INDEX

log = logging.getLogger("qatune")

_BOOKKEEPING = {"row", "n_items", "n_tokens"}

# Config attributes of causal LMs whose logits are not just lm_head(hidden).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "logit_softcapping")


class CausalLMObjective(nn.Module):
    """Next-token cross-entropy over supervised positions only.

    When the model's logits are a plain linear head over the last hidden state, the head is applied
    to the supervised positions alone (for QA that is the answer and its EOS, a small share of the
    sequence), and the backbone computes only what those positions need (:mod:`qatune.lean_causal`: a
    prompt prefix shared by the batch's rows, or by groups of them, computed once; the last layer's
    projections on the supervised positions; each checked per model). Otherwise the full logits are
    computed. GPT-2 has its own lean path (:mod:`qatune.lean_gpt2`).
    """

    def __init__(self, model: nn.Module, lean: bool = True):
        super().__init__()
        self.model = model
        self.selective = _selective_head_matches(model)
        self.lean_refused = self.selective and not lean and lean_gpt2.supported(model)
        self.lean = self.selective and lean and _lean_path_matches(model)
        self.paths: dict[str, bool] = {}
        if self.selective and not self.lean:
            for feature in lean_causal.FEATURES:
                # Not for GPT-2 with its lean path turned off: two forwards per step for a 2-token `Question:`
                # prefix were not measured (bench/shared_prefix_cache.py --workload w1 measures it).
                wanted = not (feature in ("prefix", "groups") and self.lean_refused)
                self.paths[feature] = wanted and lean_causal.check(model, feature, self.paths)
        self.prefix_once = self.paths.get("prefix", False)
        self.groups = self.paths.get("groups", False)
        self.last_rows = self.paths.get("last_rows", False)
        self.unpadded = self.paths.get("unpadded", False)

    def describe(self) -> str:
        if self.lean:
            return f"GPT-2 lean path (LM head and last block on the supervised positions only, {self._prefix()})"
        head = "LM head on the supervised positions only"
        if self.last_rows:
            head = "LM head and the last layer's projections on the supervised positions only"
        if self.unpadded:
            head += ", no padding through the projections and MLPs"
        if self.prefix_once or self.groups:
            through = "" if lean_gpt2.has_dropout(self.model) else " (through the model's cache)"
            head += f", {self._prefix()}{through}"
        if self.lean_refused:
            return f"{head} (GPT-2's lean path turned off)"
        if self.selective:
            return head
        return "full logits (the model's output is not a plain linear head)"

    def _prefix(self) -> str:
        if lean_gpt2.has_dropout(self.model):
            return "prompt prefix not shared while training: dropout is active"
        if self.groups and not self.lean:
            common = "the batch's common one, or " if self.prefix_once else ""
            return f"shared prompt prefixes computed once per batch: {common}each group's where rows share a longer one"
        return "shared prompt prefix computed once per batch"

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                shared_prefix: int = 0, prefix_groups: dict[str, Any] | None = None, **_: Any
                ) -> dict[str, torch.Tensor]:
        # The last column predicts nothing (no target follows it) and, the model being causal, no other position
        # reads it: it is left out of the forward, exactly (for QA rows of ~20 tokens, 5% of the work).
        input_ids, attention_mask = input_ids[:, :-1], attention_mask[:, :-1]
        targets = labels[:, 1:]
        supervised = targets != IGNORE_INDEX
        if self.lean:
            head = self.model.get_output_embeddings()
            multiple = HEAD_ROWS_MULTIPLE if _kernels_per_shape(head.weight) else 1
            hidden = lean_gpt2.supervised_hidden(self.model, input_ids, supervised, shared_prefix, multiple)
            logits = _head_on_rows(head, hidden)
        elif self.selective:
            share = not lean_gpt2.dropout_active(self.model)
            prefix = shared_prefix if share and self.prefix_once else 0
            groups = prefix_groups if share and self.groups else None
            # The collator keeps every supervised position after the shared prefixes.
            hidden = lean_causal.supervised_hidden(self.model, input_ids, attention_mask, supervised, prefix,
                                                   self.last_rows, groups, self.unpadded)
            logits = _head_on_rows(self.model.get_output_embeddings(), hidden)
        else:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits[supervised]
        loss_sum = F.cross_entropy(logits.float(), targets[supervised], reduction="sum")
        return {"loss_sum": loss_sum, "count": supervised.sum(), "logit_absmax": _absmax(logits)}


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
        return {"loss_sum": loss_sum, "count": count, "logit_absmax": _absmax(start_logits.masked_fill(
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
        return {"loss_sum": loss_sum, "count": supervised.sum(), "logit_absmax": _absmax(logits)}


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


def objective_for(task: str, model: nn.Module, lean: bool = True) -> nn.Module:
    """The training objective of a model (``lean``: GPT-2's lean path where it reproduces the model's logits;
    off only to measure it, bench/lean_precision.py)."""
    fuse_activations(model)
    one_pass = lean_lora.install(model)
    if one_pass:
        log.info("LoRA: %d adapted layers add their adapter's product into the base layer's (one pass, where no "
                 "autocast or adapter dropout is active)", one_pass)
    if task == "extractive":
        return SpanObjective(model)
    if is_encoder_decoder(model):
        return Seq2SeqObjective(model)
    return CausalLMObjective(model, lean=lean)


def is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def fuse_activations(model: nn.Module) -> int:
    """Swap transformers' Python tanh-GELU (GPT-2's gelu_new: 6 elementwise kernels) for torch's fused
    one. Same function; the model's config and saved weights are unchanged. Returns the number swapped."""
    try:
        from transformers.activations import NewGELUActivation, PytorchGELUTanh
    except ImportError:
        return 0
    swapped = 0
    for module in model.modules():
        for name, child in module.named_children():
            if type(child) is NewGELUActivation:
                setattr(module, name, PytorchGELUTanh())
                swapped += 1
    return swapped


def count_items(batch: dict[str, torch.Tensor], task: str) -> int:
    """Supervised tokens (generative) or labelled windows (extractive) in a batch."""
    if "n_items" in batch:
        return int(batch["n_items"])
    if task == "generative":
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    return int((batch["start_positions"] != IGNORE_INDEX).sum())


def count_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Non-padding tokens in a batch."""
    return int(batch["n_tokens"]) if "n_tokens" in batch else int(batch["attention_mask"].sum())


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors an objective takes (drops bookkeeping such as source row numbers)."""
    return {key: value for key, value in batch.items() if key not in _BOOKKEEPING}


HEAD_ROWS_MULTIPLE = 64


def _head_on_rows(head: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """``head(rows)`` for (N, d) rows, computed over N rounded up to a multiple of HEAD_ROWS_MULTIPLE.

    N, the supervised tokens of a batch, is new at almost every step, and matrix kernels are prepared
    per shape (oneDNN on CPU builds one for each new size): a few zero rows cost less than that.
    """
    n = rows.shape[0]
    extra = -n % HEAD_ROWS_MULTIPLE
    if not extra:
        return head(rows)
    return head(torch.cat([rows, rows.new_zeros(extra, rows.shape[1])]))[:n]


def _kernels_per_shape(weight: torch.Tensor) -> bool:
    """Whether products with ``weight`` are prepared per shape: oneDNN (bf16 on CPU) builds kernels for each new
    one, a GPU warms them up; MKL (fp32 on CPU) prepares nothing. GPT-2's lean path rounds its last block's rows
    up where they are: on W1 under bf16 on an AMD EPYC with AVX512-BF16 the path is x1.068 faster than the plain
    forward with it (bench/lean_precision_amd_bf16.json)."""
    return not (weight.device.type == "cpu" and weight.dtype == torch.float32)


def _absmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.detach().abs().max() if logits.numel() else torch.zeros((), device=logits.device)


def _selective_head_matches(model: nn.Module) -> bool:
    """True when lm_head(backbone(x)) reproduces the model's own logits (checked once per model)."""
    return lean_causal.checked_once(model, "_qatune_selective_head", _check_selective_head)


def _lean_path_matches(model: nn.Module) -> bool:
    """True when :mod:`qatune.lean_gpt2` applies to the model and reproduces its logits (checked once)."""
    return lean_causal.checked_once(model, "_qatune_lean_path", lambda m: lean_gpt2.supported(m)
                                    and lean_gpt2.matches_model(m, m.get_output_embeddings()))


def _check_selective_head(model: nn.Module) -> bool:
    """Compare lm_head(backbone(x)) with the model's own logits on a tiny input."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return False
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    prefix = getattr(inner, "base_model_prefix", "")
    if not isinstance(head, nn.Linear) or not prefix or not isinstance(getattr(inner, prefix, None), nn.Module):
        return False
    device = head.weight.device
    ids = torch.arange(1, 5, device=device).remainder(head.out_features).unsqueeze(0)
    mask = torch.ones_like(ids)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            full = model(input_ids=ids, attention_mask=mask).logits
            hidden = lean_causal.backbone(model)(input_ids=ids, attention_mask=mask).last_hidden_state
            mine = head(hidden)
        if full.shape == mine.shape and torch.allclose(full.float(), mine.float(), atol=1e-4, rtol=1e-4):
            return True
        log.debug("LM head on supervised positions only: not used, lm_head(backbone(x)) differs from the "
                  "logits of %s", type(model).__name__)
        return False
    except Exception as exc:  # any architecture not fitting the pattern falls back to full logits
        log.debug("LM head on supervised positions only: not used for %s (%s: %s)", type(model).__name__,
                  type(exc).__name__, exc)
        return False
    finally:
        model.train(was_training)
