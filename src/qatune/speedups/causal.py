"""A causal LM's training loss (any transformers architecture) that computes only what it reads.

The loss of a generative QA row reads the final hidden state at its answer positions alone. What follows
from that, each a path of its own (named as ``train.speedups`` names it), each used for a model only after a
check on a tiny batch (:func:`check`) has reproduced the model's own outputs with it, and all of it on the
model's own modules (LoRA adapters still apply):

* ``last_column``: a batch's last column predicts nothing (no target follows it) and, the model being causal,
  no other position reads it: it is left out of the forward.
* ``supervised_head``: the LM head (and the loss) on the supervised positions only, where the model's logits
  are a plain linear head over the backbone's last hidden state; its rows are rounded up where matrix kernels
  are built per shape.
* ``shared_prefix``: the leading tokens every row of the batch has in common (a chat template's system prompt)
  run for one row; their keys and values reach every row through the model's own cache, and their gradients
  add up over the rows through it.
* ``prefix_groups``: where rows of a batch share a longer prefix by group (questions about one context,
  :func:`qatune.speedups.prefixes.plan`), each group's prefix runs once, as one right-padded row of a prefix
  batch; each row then runs its own rest with its group's keys and values from the cache (padding in between
  masked out), at its own positions.
* ``last_layer_rows``: every layer but the last must run on every position (later layers attend to its keys
  and values), but the last one's attention output projection and MLP matter only where the loss reads them:
  they run on those rows, and the others get zeros (a final state that nothing reads).
* ``unpadded_rows``: each layer's query, key, value and output projections and its MLP run on the real tokens
  only, the padding positions get zeros. Attention still sees the padded rows (their mask keeps padding out of
  every real position's keys), so a batch's rows of different lengths cost their own lengths in the matrix
  products.

GPT-2 has its own path (``gpt2_supervised_rows``, :mod:`qatune.speedups.gpt2`). The prefixes are shared only
while no dropout is active: with dropout each row must draw its own noise on its prefix.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from qatune.data.padding import IGNORE_INDEX
from qatune.model.kv_cache import cache_argument
from qatune.model.objectives import CausalLMObjective, absmax, weighted_cross_entropy
from qatune.speedups import fewer_rows, gpt2, prefixes
from qatune.speedups.attention import AttentionByWidth, each_attention
from qatune.speedups.checks import close_enough, close_to_scale, remembered
from qatune.speedups.shapes import HEAD_ROWS_MULTIPLE, kernels_per_shape, rows_multiple

log = logging.getLogger("qatune")


def supervised_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      selected: torch.Tensor, prefix: int = 0, last_rows: bool = False,
                      groups: dict[str, Any] | None = None, unpadded: bool = False) -> torch.Tensor:
    """The backbone's last hidden states at the ``selected`` positions ((B, T) mask), in row-major order.
    ``prefix``: leading tokens every row shares and where nothing is selected (0: none); ``groups``: prefixes
    shared by groups of rows instead (:func:`qatune.speedups.prefixes.plan`; None: ``prefix`` applies)."""
    net = backbone(model)
    if groups is not None:
        return _grouped(net, input_ids, attention_mask, selected, groups, last_rows, unpadded)
    prefix = prefix if 0 < prefix < input_ids.shape[1] and input_ids.shape[0] > 1 else 0
    index = selected[:, prefix:].reshape(-1).nonzero().squeeze(1)  # flat, row-major: as boolean indexing orders
    multiple = rows_multiple(next(net.parameters()))
    fewer = fewer_rows.hooks(net, attention_mask[:, prefix:], index if last_rows else None, unpadded, multiple)
    if not prefix:
        with fewer:
            hidden = net(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    else:
        name = cache_argument(net)
        first = net(input_ids=input_ids[:1, :prefix], attention_mask=attention_mask[:1, :prefix], use_cache=True)
        cache = getattr(first, name)
        cache.batch_repeat_interleave(input_ids.shape[0])
        with fewer:
            hidden = net(input_ids=input_ids[:, prefix:], attention_mask=attention_mask, use_cache=True,
                         **{name: cache}).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)


def _grouped(net: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, selected: torch.Tensor,
             groups: dict[str, Any], last_rows: bool, unpadded: bool) -> torch.Tensor:
    device, width = input_ids.device, input_ids.shape[1]
    rows, lengths, group = (groups[key].to(device, non_blocking=True) for key in ("rows", "lengths", "group"))
    prefix_width, suffix_width = groups["prefix_width"], groups["suffix_width"]
    prefix_ids = input_ids.index_select(0, rows)[:, :prefix_width]  # (G, P): each group's prefix, right-padded
    prefix_mask = (torch.arange(prefix_width, device=device) < lengths[:, None]).long()
    columns = lengths.index_select(0, group)[:, None] + torch.arange(suffix_width, device=device)  # (B, S)
    inside = columns < width
    columns = columns.clamp(max=width - 1)
    mask = attention_mask.gather(1, columns) * inside
    chosen = selected.gather(1, columns) & inside
    index = chosen.reshape(-1).nonzero().squeeze(1)
    name = cache_argument(net)
    multiple = rows_multiple(next(net.parameters()))
    with fewer_rows.hooks(net, prefix_mask, None, unpadded, multiple):
        first = net(input_ids=prefix_ids, attention_mask=prefix_mask, use_cache=True)
    cache = getattr(first, name)
    _select_rows(cache, group)
    with fewer_rows.hooks(net, mask, index if last_rows else None, unpadded, multiple):
        hidden = net(input_ids=input_ids.gather(1, columns), position_ids=columns, use_cache=True,
                     attention_mask=torch.cat([prefix_mask.index_select(0, group), mask], 1),
                     **{name: cache}).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)


def _select_rows(cache: Any, index: torch.Tensor) -> None:
    """``cache.batch_select_indices(index)``, through ``index_select`` where the cache is transformers' plain
    keys and values per layer. transformers indexes them (``keys[index, ...]``), whose backward adds the rows'
    gradients up with an accumulating ``index_put_``, several times slower on a CPU than ``index_select``'s
    ``index_add_``."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        DynamicLayer = None
    layers = getattr(cache, "layers", None)
    if DynamicLayer is None or not layers or any(type(layer) is not DynamicLayer for layer in layers):
        cache.batch_select_indices(index)
        return
    for layer in layers:
        if layer.get_seq_length() > 0:
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)


def backbone(model: nn.Module) -> nn.Module:
    # A peft model forwards attribute lookups, and its own ``model`` attribute shadows Llama's backbone
    # (base_model_prefix "model"): look the backbone up on the wrapped transformers model.
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(inner, inner.base_model_prefix)


HIDDEN_PATHS = ("shared_prefix", "prefix_groups", "last_layer_rows", "unpadded_rows")
"""The paths inside :func:`supervised_hidden`, in the order they are checked (each with those accepted before)."""
CAUSAL_PATHS = ("last_column", "supervised_head", "gpt2_supervised_rows", *HIDDEN_PATHS)


class SupervisedRowsObjective(CausalLMObjective):
    """The causal loss, computing only what it reads: the ``paths`` (of CAUSAL_PATHS) that :func:`choose` found
    exact for the model. The same loss and gradients as :class:`qatune.model.objectives.CausalLMObjective`, to
    rounding."""

    def __init__(self, model: nn.Module, paths: frozenset[str] | set[str]):
        super().__init__(model)
        self.paths = frozenset(paths)
        self.reasons: dict[str, str | None] = {}
        """Why each path is off (None: on), as :func:`choose` found."""

    @classmethod
    def checked(cls, model: nn.Module, wanted: tuple[str, ...] | set[str] = CAUSAL_PATHS,
                attention: AttentionByWidth | None = None, slack: float = 1.0) -> SupervisedRowsObjective:
        """The loss with each of the ``wanted`` paths that :func:`choose` finds exact for the model."""
        reasons = choose(model, set(wanted), attention, slack)
        objective = cls(model, {name for name, why in reasons.items() if why is None})
        objective.reasons = reasons
        return objective

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                shared_prefix: int = 0, prefix_groups: dict[str, Any] | None = None,
                label_weights: torch.Tensor | None = None, **_: Any) -> dict[str, torch.Tensor]:
        paths = self.paths
        targets = labels[:, 1:]
        supervised = targets != IGNORE_INDEX
        if "last_column" in paths:
            input_ids, attention_mask = input_ids[:, :-1], attention_mask[:, :-1]
            selected = supervised
        else:  # the last position is computed, and read by nothing
            selected = torch.cat([supervised, supervised.new_zeros(supervised.shape[0], 1)], 1)
        if "gpt2_supervised_rows" in paths:
            head = self.model.get_output_embeddings()
            multiple = HEAD_ROWS_MULTIPLE if kernels_per_shape(head.weight) else 1
            hidden = gpt2.supervised_hidden(self.model, input_ids, selected, shared_prefix, multiple)
            logits = head_on_rows(head, hidden)
        elif "supervised_head" in paths:
            share = not gpt2.dropout_active(self.model)
            prefix = shared_prefix if share and "shared_prefix" in paths else 0
            groups = prefix_groups if share and "prefix_groups" in paths else None
            # The planner keeps every supervised position after the shared prefixes.
            hidden = supervised_hidden(self.model, input_ids, attention_mask, selected, prefix,
                                       "last_layer_rows" in paths, groups, "unpadded_rows" in paths)
            logits = head_on_rows(self.model.get_output_embeddings(), hidden)
        else:
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits[selected]
        loss_sum = weighted_cross_entropy(logits, targets, supervised, label_weights)
        return {"loss_sum": loss_sum, "count": supervised.sum(), "logit_absmax": absmax(logits)}


def head_on_rows(head: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """``head(rows)`` for (N, d) rows, computed over N rounded up to a multiple of HEAD_ROWS_MULTIPLE (N, the
    supervised tokens of a batch, is new at almost every step): a few zero rows cost less than a kernel built
    for a new shape."""
    n = rows.shape[0]
    extra = -n % HEAD_ROWS_MULTIPLE
    if not extra:
        return head(rows)
    return head(torch.cat([rows, rows.new_zeros(extra, rows.shape[1])]))[:n]


def choose(model: nn.Module, wanted: set[str], attention: AttentionByWidth | None = None, slack: float = 1.0
           ) -> dict[str, str | None]:
    """Which of the ``wanted`` CAUSAL_PATHS a causal LM takes: name -> None where it is on, else why it is off.

    Each path's check runs on the model where it is, under each attention ``attention`` may pick; ``slack``
    loosens the tolerances under reduced precision (:data:`qatune.speedups.checks.REDUCED_PRECISION_SLACK`)."""
    found: dict[str, str | None] = {}
    key = (attention is not None, slack, _placement(model))
    found["last_column"] = None if "last_column" in wanted else "not listed"
    if "supervised_head" not in wanted:
        found["supervised_head"] = "not listed"
    elif not remembered(model, ("supervised_head", *key), lambda m: _check_head(m, 1e-4 * slack)):
        found["supervised_head"] = "the model's logits are not a plain linear head over its last hidden state"
    else:
        found["supervised_head"] = None
    head_on = found["supervised_head"] is None
    is_gpt2 = gpt2.supported(model)
    if "gpt2_supervised_rows" not in wanted:
        found["gpt2_supervised_rows"] = "not listed" if is_gpt2 else "not a GPT-2"
    elif not is_gpt2:
        found["gpt2_supervised_rows"] = "not a GPT-2"
    elif not head_on:
        found["gpt2_supervised_rows"] = "needs supervised_head"
    elif not remembered(model, ("gpt2_supervised_rows", *key), lambda m: gpt2.matches_model(
            m, m.get_output_embeddings(), attention, 1e-4 * slack)):
        found["gpt2_supervised_rows"] = "its check did not reproduce the model's logits (-v says where)"
    else:
        found["gpt2_supervised_rows"] = None
    accepted: dict[str, bool] = {}
    for path in HIDDEN_PATHS:
        if found["gpt2_supervised_rows"] is None:
            why = "gpt2_supervised_rows computes GPT-2's rows itself"
        elif path not in wanted:
            why = "not listed"
        elif not head_on:
            why = "needs supervised_head"
        elif is_gpt2 and "gpt2_supervised_rows" not in wanted and path in ("shared_prefix", "prefix_groups"):
            # Two forwards per step for GPT-2's two-token `Question:` prefix were not measured.
            why = "not measured for GPT-2 without gpt2_supervised_rows"
        else:
            passed = remembered(model, (path, tuple(sorted(n for n, ok in accepted.items() if ok)), *key),
                                lambda m, p=path: _check(m, p, accepted, attention, 1e-3 * slack))
            why = None if passed else _NOT_USED.get((path, _reason(model, path)), "its check did not reproduce the "
                                                    "model's hidden states (-v says where)")
        accepted[path] = why is None
        found[path] = why
    return found


def _placement(model: nn.Module) -> tuple[str, str]:
    weight = next(model.parameters(), None)
    return (str(weight.device), str(weight.dtype)) if weight is not None else ("", "")


def _reason(model: nn.Module, path: str) -> str:
    """Why a path cannot apply to a model's structure ("" when its structure fits and only the check decides)."""
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        return "checkpointing"
    net = backbone(model)
    if path == "last_layer_rows" and not fewer_rows.has_last_rows(net):
        return "structure"
    if path == "unpadded_rows" and not fewer_rows.has_position_wise(net):
        return "structure"
    if path == "prefix_groups" and _windowed(getattr(model, "config", None)):
        return "windowed"
    return ""


_NOT_USED = {
    ("shared_prefix", "checkpointing"): "gradient checkpointing recomputes forwards without the cache",
    ("prefix_groups", "checkpointing"): "gradient checkpointing recomputes forwards without the cache",
    ("last_layer_rows", "checkpointing"): "gradient checkpointing recomputes forwards without the row hooks",
    ("unpadded_rows", "checkpointing"): "gradient checkpointing recomputes forwards without the row hooks",
    ("last_layer_rows", "structure"): "the model's last layer has no self_attn.o_proj and mlp",
    ("unpadded_rows", "structure"): "the model's layers have no q/k/v/o projections and mlp",
    ("prefix_groups", "windowed"): "sliding-window attention counts cache slots, which a group's padding shifts",
}


def check(model: nn.Module, path: str, accepted: dict[str, bool], attention: AttentionByWidth | None = None,
          tolerance: float = 1e-3) -> bool:
    """True when :func:`supervised_hidden` with ``path`` on (and the ``accepted`` paths before it) reproduces the
    backbone's own hidden states on a tiny batch: four rows sharing a 2-token prefix, three of them a 4-token
    one, one right-padded; with each prefix layout accepted so far."""
    return _check(model, path, accepted, attention, tolerance)


def _check(model: nn.Module, path: str, accepted: dict[str, bool], attention: AttentionByWidth | None,
           tolerance: float) -> bool:
    net = backbone(model)
    if _reason(model, path):
        return False
    head = model.get_output_embeddings()
    device = head.weight.device
    rows = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 10], [1, 2, 11, 12, 13], [1, 2, 3, 4, 7, 8]]
    rows = [[token % head.out_features for token in row] for row in rows]
    ids = torch.tensor([row + [0] * (6 - len(row)) for row in rows], device=device)
    mask = torch.tensor([[1] * len(row) + [0] * (6 - len(row)) for row in rows], device=device)
    selected = torch.zeros_like(mask, dtype=torch.bool)
    selected[0, 4:] = selected[1, 4:] = selected[2, 3:5] = selected[3, 5:] = True
    options = {name: accepted.get(name, False) for name in HIDDEN_PATHS} | {path: True}
    layouts = [(0, None)] if path in ("last_layer_rows", "unpadded_rows") else []
    if options["shared_prefix"] and path != "prefix_groups":
        layouts.append((2, None))
    if options["prefix_groups"]:
        groups = prefixes.plan(rows, [4, 4, 3, 5], 6)
        if groups is None:
            return False  # a vocabulary too small for the check's tokens to differ
        layouts.append((0, groups))
    was_training = model.training
    model.eval()
    try:
        for each in each_attention(attention):  # under each attention the run may use
            with each, torch.no_grad():
                whole = net(input_ids=ids, attention_mask=mask).last_hidden_state[selected]
                for prefix, groups in layouts:
                    mine = supervised_hidden(model, ids, mask, selected, prefix, options["last_layer_rows"], groups,
                                             options["unpadded_rows"])
                    # Products at another batch size or through another kernel round differently (SmolLM2: 2e-3
                    # on hidden states of up to 55). A real difference (positions, masks) is of the size of the
                    # states.
                    if not close_to_scale(mine, whole, tolerance):
                        log.debug("%s: not used, the hidden states differ for %s (shared prefix %d, groups %s, "
                                  "attention %s)", path, type(model).__name__, prefix, groups is not None,
                                  getattr(getattr(net, "config", None), "_attn_implementation", None))
                        return False
        return True
    except Exception as exc:  # an architecture that does not fit: the backbone's own forward instead
        log.debug("%s: not used for %s (%s: %s)", path, type(model).__name__, type(exc).__name__, exc)
        return False
    finally:
        model.train(was_training)


_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "logit_softcapping")
"""Config attributes of causal LMs whose logits are not just lm_head(hidden)."""


def _check_head(model: nn.Module, tolerance: float) -> bool:
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
            hidden = backbone(model)(input_ids=ids, attention_mask=mask).last_hidden_state
            mine = head(hidden)
        if close_enough(mine, full, tolerance):
            return True
        log.debug("supervised_head: not used, lm_head(backbone(x)) differs from the logits of %s", type(model).__name__)
        return False
    except Exception as exc:  # any architecture not fitting the pattern falls back to full logits
        log.debug("supervised_head: not used for %s (%s: %s)", type(model).__name__, type(exc).__name__, exc)
        return False
    finally:
        model.train(was_training)


def _windowed(config: Any) -> bool:
    """Whether some layer of the model attends within a sliding window (or chunks) only."""
    layer_types = getattr(config, "layer_types", None) or ()
    return bool(getattr(config, "sliding_window", None)) or any("sliding" in t or "chunked" in t for t in layer_types)
