"""A causal LM's training forward (any transformers architecture) that computes only what the QA loss reads.

The loss of a generative QA row reads the final hidden state at its answer positions alone. What follows
from that, each part used for a model only after a check on a tiny batch (:func:`check`) has reproduced the
model's own hidden states with it, and all of it on the model's own modules (LoRA adapters still apply):

* **A shared prompt prefix computed once** (``prefix``): the leading tokens every row of the batch has in
  common (a chat template's system prompt) run for one row; their keys and values reach every row through
  the model's own cache, and their gradients add up over the rows through it.
* **Each group's prompt prefix computed once** (``groups``): where rows of a batch share a longer prefix by
  group (questions about one context, :func:`qatune.data.prefixes.plan`), each group's prefix runs once, as one
  right-padded row of a prefix batch; each row then runs its own rest with its group's keys and values from
  the cache (padding in between masked out), at its own positions.
* **The last layer's position-wise work on the read positions only** (``last_rows``): every layer but the
  last must run on every position (later layers attend to its keys and values), but the last one's
  attention output projection and MLP matter only where the loss reads them: they run on those rows, and
  the others get zeros (a final state that nothing reads).
* **No padding in the position-wise work** (``unpadded``): each layer's query, key, value and output
  projections and its MLP run on the real tokens only, the padding positions get zeros. Attention still
  sees the padded rows (their mask keeps padding out of every real position's keys), so a batch's rows
  of different lengths cost their own lengths in the matrix products, which are most of a step.

GPT-2 has its own path (:mod:`qatune.lean_gpt2`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Any

import torch
from torch import nn

from qatune.attention import each_attention
from qatune.data import prefixes

log = logging.getLogger("qatune")


def supervised_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      selected: torch.Tensor, prefix: int = 0, last_rows: bool = False,
                      groups: dict[str, Any] | None = None, unpadded: bool = False) -> torch.Tensor:
    """The backbone's last hidden states at the ``selected`` positions ((B, T) mask), in row-major order.
    ``prefix``: leading tokens every row shares and where nothing is selected (0: none); ``groups``: prefixes
    shared by groups of rows instead (:func:`qatune.data.prefixes.plan`; None: ``prefix`` applies)."""
    net = backbone(model)
    if groups is not None:
        return _grouped(net, input_ids, attention_mask, selected, groups, last_rows, unpadded)
    prefix = prefix if 0 < prefix < input_ids.shape[1] and input_ids.shape[0] > 1 else 0
    index = selected[:, prefix:].reshape(-1).nonzero().squeeze(1)  # flat, row-major: as boolean indexing orders
    rows = _rows(net, attention_mask[:, prefix:], index if last_rows else None, unpadded)
    if not prefix:
        with rows:
            hidden = net(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    else:
        name = _cache_argument(net)
        first = net(input_ids=input_ids[:1, :prefix], attention_mask=attention_mask[:1, :prefix], use_cache=True)
        cache = getattr(first, name)
        cache.batch_repeat_interleave(input_ids.shape[0])
        with rows:
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
    name = _cache_argument(net)
    with _rows(net, prefix_mask, None, unpadded):
        first = net(input_ids=prefix_ids, attention_mask=prefix_mask, use_cache=True)
    cache = getattr(first, name)
    _select_rows(cache, group)
    with _rows(net, mask, index if last_rows else None, unpadded):
        hidden = net(input_ids=input_ids.gather(1, columns), position_ids=columns, use_cache=True,
                     attention_mask=torch.cat([prefix_mask.index_select(0, group), mask], 1),
                     **{name: cache}).last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)


def _select_rows(cache: Any, index: torch.Tensor) -> None:
    """``cache.batch_select_indices(index)``, through ``index_select`` where the cache is transformers' plain
    keys and values per layer. transformers indexes them (``keys[index, ...]``), whose backward adds the rows'
    gradients up with an accumulating ``index_put_``: on a CPU five times as slow as ``index_select``'s
    ``index_add_`` (1.1% of a W2 step in fp32 in the profile; within the noise of whole steps)."""
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


def _rows(net: nn.Module, mask: torch.Tensor, read: torch.Tensor | None, unpadded: bool) -> Any:
    """What runs on fewer rows in a forward over ``mask`` ((B, T), 1 on real tokens): with ``read`` (the
    flattened positions the loss reads) the last layer's output projection and MLP on those; with
    ``unpadded`` every other position-wise module on the real tokens, where the batch holds padding."""
    modules: list[tuple[nn.Module, torch.Tensor]] = []
    if read is not None:
        last = net.layers[-1]
        modules += [(last.self_attn.o_proj, read), (last.mlp, read)]
    real = mask.reshape(-1).nonzero().squeeze(1) if unpadded else None
    if real is not None and len(real) < mask.numel():
        taken = {id(module) for module, _ in modules}
        modules += [(module, real) for layer in net.layers for module in _position_wise(layer)
                    if id(module) not in taken]
    return _Rows(modules) if modules else contextlib.nullcontext()


def _position_wise(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's modules that work position by position: its attention's projections and its MLP."""
    attention = getattr(layer, "self_attn", None)
    found = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    found.append(getattr(layer, "mlp", None))
    return [module for module in found if isinstance(module, nn.Module)]


class _Rows:
    """While entered: each module computes the rows at its index (of the flattened positions) only: a forward
    pre-hook gathers its input rows, a forward hook scatters its output rows into zeros. Modules called on
    one tensor with one index in turn (the query, key and value projections) share its gather."""

    def __init__(self, modules: list[tuple[nn.Module, torch.Tensor]]):
        self.modules = modules
        self.handles: list[Any] = []
        self.shapes: dict[int, torch.Size] = {}
        self.gathered: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __enter__(self) -> None:
        for module, index in self.modules:
            self.handles.append(module.register_forward_pre_hook(functools.partial(self._gather, index)))
            self.handles.append(module.register_forward_hook(functools.partial(self._scatter, index)))

    def __exit__(self, *_: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.gathered = None

    def _gather(self, index: torch.Tensor, module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        self.shapes[id(module)] = x.shape[:-1]
        if self.gathered is None or self.gathered[0] is not x or self.gathered[1] is not index:
            self.gathered = (x, index, x.reshape(-1, x.shape[-1]).index_select(0, index))
        return (self.gathered[2], *args[1:])

    def _scatter(self, index: torch.Tensor, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        shape = self.shapes.pop(id(module))
        full = out.new_zeros(shape.numel(), out.shape[-1]).index_copy_(0, index, out)
        return full.view(*shape, out.shape[-1])


@functools.cache
def _cache_argument_of(forward: Any) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _cache_argument(net: nn.Module) -> str:
    """What the backbone calls its key/value cache, in its arguments and outputs: ``cache`` (transformers from
    5.2x on) or ``past_key_values`` (before; later ones still take it, with a deprecation warning)."""
    return _cache_argument_of(type(net).forward)


def backbone(model: nn.Module) -> nn.Module:
    # A peft model forwards attribute lookups, and its own ``model`` attribute shadows Llama's backbone
    # (base_model_prefix "model"): look the backbone up on the wrapped transformers model.
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(inner, inner.base_model_prefix)


def checked_once(model: nn.Module, attribute: str, check: Any) -> bool:
    """``check(model)``, remembered on the model (evaluations build objectives every epoch)."""
    cached = getattr(model, attribute, None)
    if cached is None:
        cached = bool(check(model))
        try:
            setattr(model, attribute, cached)
        except AttributeError:
            pass  # a module that refuses new attributes: the check simply runs again next time
    return cached


FEATURES = ("prefix", "groups", "last_rows", "unpadded")


def check(model: nn.Module, feature: str, accepted: dict[str, bool]) -> bool:
    """True when :func:`supervised_hidden` with ``feature`` on (and the ``accepted`` features before it)
    reproduces the backbone's own hidden states on a tiny batch: four rows sharing a 2-token prefix, three of
    them a 4-token one, one right-padded; with each prefix layout accepted so far. Remembered on the model."""
    return checked_once(model, f"_qatune_{feature}", functools.partial(_check, feature=feature, accepted=accepted))


def _check(model: nn.Module, feature: str, accepted: dict[str, bool]) -> bool:
    net = backbone(model)
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        # transformers turns the cache off while checkpointing, and its recomputed forwards run without the
        # hooks that pick rows.
        return False
    if feature == "last_rows" and not _has_last_rows(net):
        return False
    if feature == "unpadded" and not _has_position_wise(net):
        return False
    if feature == "groups" and _windowed(getattr(model, "config", None)):
        # Windows are counted in cache slots, and a group's padded prefix puts padding slots before each row.
        log.debug("%s: not used for %s (sliding-window attention)", _WHAT[feature], type(model).__name__)
        return False
    head = model.get_output_embeddings()
    device = head.weight.device
    rows = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 10], [1, 2, 11, 12, 13], [1, 2, 3, 4, 7, 8]]
    rows = [[token % head.out_features for token in row] for row in rows]
    ids = torch.tensor([row + [0] * (6 - len(row)) for row in rows], device=device)
    mask = torch.tensor([[1] * len(row) + [0] * (6 - len(row)) for row in rows], device=device)
    selected = torch.zeros_like(mask, dtype=torch.bool)
    selected[0, 4:] = selected[1, 4:] = selected[2, 3:5] = selected[3, 5:] = True
    options = {name: accepted.get(name, False) for name in FEATURES} | {feature: True}
    layouts = [(0, None)] if feature in ("last_rows", "unpadded") else []
    if options["prefix"] and feature != "groups":
        layouts.append((2, None))
    if options["groups"]:
        groups = prefixes.plan(rows, [4, 4, 3, 5], 6)
        if groups is None:
            return False  # a vocabulary too small for the check's tokens to differ
        layouts.append((0, groups))
    # Under each attention the run may use (bf16 on CPU switches between eager and SDPA by batch width).
    attentions = each_attention(model)
    was_training = model.training
    model.eval()
    try:
        for attention in attentions:
            with attention, torch.no_grad():
                whole = net(input_ids=ids, attention_mask=mask).last_hidden_state[selected]
                for prefix, groups in layouts:
                    mine = supervised_hidden(model, ids, mask, selected, prefix, options["last_rows"], groups,
                                             options["unpadded"])
                    # Products at another batch size or through another kernel round differently (SmolLM2: 2e-3
                    # on hidden states of up to 55). A real difference (positions, masks) is of the size of the
                    # states.
                    if mine.shape != whole.shape or (mine - whole).abs().max() > 1e-3 * whole.abs().max():
                        log.debug("%s: not used, the hidden states differ for %s (shared prefix %d, groups %s, "
                                  "attention %s)", _WHAT[feature], type(model).__name__, prefix, groups is not None,
                                  getattr(getattr(net, "config", None), "_attn_implementation", None))
                        return False
        return True
    except Exception as exc:  # an architecture that does not fit: the backbone's own forward instead
        log.debug("%s: not used for %s (%s: %s)", _WHAT[feature], type(model).__name__, type(exc).__name__, exc)
        return False
    finally:
        model.train(was_training)


_WHAT = {"prefix": "shared prompt prefix", "groups": "prompt prefixes shared by groups of rows",
         "last_rows": "last layer on the supervised positions only",
         "unpadded": "projections and MLPs on the real tokens only"}


def _windowed(config: Any) -> bool:
    """Whether some layer of the model attends within a sliding window (or chunks) only."""
    layer_types = getattr(config, "layer_types", None) or ()
    return bool(getattr(config, "sliding_window", None)) or any("sliding" in t or "chunked" in t for t in layer_types)


def _has_last_rows(net: nn.Module) -> bool:
    layers = getattr(net, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return False
    last = layers[-1]
    return isinstance(getattr(last, "mlp", None), nn.Module) and isinstance(
        getattr(getattr(last, "self_attn", None), "o_proj", None), nn.Module)


def _has_position_wise(net: nn.Module) -> bool:
    layers = getattr(net, "layers", None)
    return isinstance(layers, nn.ModuleList) and len(layers) > 0 and all(_position_wise(layer) for layer in layers)
