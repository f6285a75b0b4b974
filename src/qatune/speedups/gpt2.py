"""``gpt2_supervised_rows``: a GPT-2 training forward that computes only what the QA loss reads.

The loss of a generative QA row needs the final hidden state at the answer positions alone (a few
of the ~20 tokens of a row). Two savings follow, both exact:

* **Last block on the supervised positions only.** Every block but the last must run on every
  position (later blocks attend to their keys and values). The last block needs its attention over
  every position, but the output projection, the MLP and the final norm only where the loss is
  read: 9/12 of that block's matrix work is skipped for the prompt and padding positions.
* **A shared prompt prefix computed once.** Rows that start with the same tokens (every row of the
  default template starts with ``Question:``) have identical hidden states there at every layer; the
  prefix runs once for the whole batch and its keys/values are broadcast to every row. Used only
  when no dropout is active: with dropout each row must draw its own noise on its prefix.

The path runs on the model's own modules (so LoRA adapters on them still apply) and is used only
after :func:`matches_model` has reproduced the model's own logits with it, where the run computes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qatune.speedups.attention import AttentionByWidth, each_attention
from qatune.speedups.checks import close_enough, remembered

log = logging.getLogger("qatune")


def supported(model: nn.Module) -> bool:
    """A GPT-2 LM (plain or LoRA-wrapped) whose structure this forward reproduces."""
    base = _base(model)
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    if not isinstance(base, GPT2LMHeadModel):
        return False
    config = base.config
    return not (config.add_cross_attention or config.reorder_and_upcast_attn
                or base.transformer.gradient_checkpointing)


def supervised_hidden(model: nn.Module, input_ids: torch.Tensor, selected: torch.Tensor,
                      shared_prefix: int = 0, rows_multiple: int = 1) -> torch.Tensor:
    """Final hidden states (after ``ln_f``) at the ``selected`` positions, in row-major order.

    ``input_ids`` are right-padded (B, T); ``selected`` is a (B, T') boolean mask, T' <= T, of the
    positions whose outputs the loss reads. ``shared_prefix`` is the number of leading tokens that
    every row has in common and that no selected position falls in (the collator computes it). The last
    block runs on the selected positions rounded up to a multiple of ``rows_multiple`` (where kernels are
    built per shape); the extra rows repeat position 0 and are cut off, so no gradient reaches them.
    """
    gpt = _base(model).transformer
    batch, width = input_ids.shape
    prefix = shared_prefix if batch > 1 and 0 < shared_prefix < width and not dropout_active(model) else 0
    rest = width - prefix
    # Hidden states are kept flat: the prefix's tokens once, then every row's remaining tokens.
    arange = torch.arange(width, device=input_ids.device)
    ids, places = input_ids[:, prefix:].reshape(-1), arange[prefix:].repeat(batch)
    if prefix:
        ids, places = torch.cat([input_ids[0, :prefix], ids]), torch.cat([arange[:prefix], places])
    x = gpt.drop(gpt.wte(ids) + gpt.wpe(places))
    rows, cols = selected.nonzero(as_tuple=True)
    picked = prefix + rows * rest + (cols - prefix)  # flat index of each selected position
    n = picked.shape[0]
    picked = F.pad(picked, (0, -n % rows_multiple))
    layout = _Layout(batch, width, prefix, input_ids.device)
    for block in gpt.h[:-1]:
        attn = block.attn
        x = x + attn.resid_dropout(attn.c_proj(_attention(attn, block.ln_1(x), layout)))
        x = x + block.mlp(block.ln_2(x))
    last = gpt.h[-1]
    attn = last.attn
    # Attention itself is cheap at QA lengths; what follows it (projection, MLP) runs where it is read.
    core = _attention(attn, last.ln_1(x), layout).index_select(0, picked)
    x = x.index_select(0, picked) + attn.resid_dropout(attn.c_proj(core))
    x = x + last.mlp(last.ln_2(x))
    return gpt.ln_f(x)[:n]


class _Layout:
    """Batch shape of the flat hidden states: ``prefix`` shared tokens, then ``rest`` per row."""

    def __init__(self, batch: int, width: int, prefix: int, device: torch.device):
        self.batch, self.width, self.prefix, self.rest = batch, width, prefix, width - prefix
        # The rest of each row sees the prefix and its own earlier tokens: a causal mask shifted by prefix.
        self.shifted_causal = (torch.ones(self.rest, width, dtype=torch.bool, device=device).tril(prefix)
                               if prefix else None)


def _attention(attn: nn.Module, h: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Causal self-attention of GPT-2 over flat hidden states: the heads' output, before ``c_proj``.

    Computed the way the model's config names at this forward: ``eager`` (matrix products and a softmax, as
    transformers' GPT-2 does it) or else SDPA (``attention_by_width`` switches between them per batch).
    """
    dim = h.shape[-1]
    heads, head_dim, scale = attn.num_heads, attn.head_dim, attn.scaling
    dropout = attn.attn_dropout.p if attn.training else 0.0
    eager = attn.config._attn_implementation == "eager"

    def split(t: torch.Tensor, batch: int) -> torch.Tensor:  # (batch * n, dim) -> (batch, heads, n, head_dim)
        return t.reshape(batch, -1, heads, head_dim).transpose(1, 2)

    def merge(t: torch.Tensor) -> torch.Tensor:  # (batch, heads, n, head_dim) -> (batch * n, dim)
        return t.transpose(1, 2).reshape(-1, dim)

    qkv = attn.c_attn(h)
    p, b = layout.prefix, layout.batch
    if not p:
        q, k, v = (split(t, b) for t in qkv.split(dim, dim=1))
        return merge(_attend(q, k, v, None, dropout, scale, eager))
    shared, own = qkv.split([p, qkv.shape[0] - p])
    sq, sk, sv = (split(t, 1) for t in shared.split(dim, dim=1))
    q, k, v = (split(t, b) for t in own.split(dim, dim=1))
    keys = torch.cat([sk.expand(b, -1, -1, -1), k], dim=2)
    values = torch.cat([sv.expand(b, -1, -1, -1), v], dim=2)
    head = _attend(sq, sk, sv, None, dropout, scale, eager)
    tail = _attend(q, keys, values, layout.shifted_causal, dropout, scale, eager)
    return torch.cat([merge(head), merge(tail)])


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, dropout: float,
            scale: float, eager: bool) -> torch.Tensor:
    """Attention of ``q`` over ``k``/``v`` where the (queries, keys) mask ``allowed`` is True (None: causal)."""
    if not eager:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=allowed is None,
                                              dropout_p=dropout, scale=scale)
    if allowed is None:
        allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    weights = F.softmax(scores, dim=-1).type(v.dtype)
    if dropout:
        weights = F.dropout(weights, p=dropout)
    return torch.matmul(weights, v)


def matches_model(model: nn.Module, head: nn.Module, attention: AttentionByWidth | None = None,
                  tolerance: float = 1e-4) -> bool:
    """Check on a tiny batch (shared prefix, a padded row) that this path gives the model's own logits, under each
    attention implementation the run may use."""
    base = _base(model)
    vocab = head.out_features
    device = head.weight.device
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 7, 8, 9, 10], [1, 2, 11, 12, 0, 0]], device=device)
    ids = ids.remainder(vocab)
    mask = torch.tensor([[1] * 6, [1] * 6, [1, 1, 1, 1, 0, 0]], device=device)
    selected = torch.zeros(3, 5, dtype=torch.bool, device=device)
    selected[0, 2:] = selected[1, 3:] = selected[2, 2:4] = True
    was_training = model.training
    model.eval()
    try:
        for each in each_attention(attention):  # under each attention the run may use
            with each, torch.no_grad():
                full = base(input_ids=ids, attention_mask=mask).logits[:, :-1][selected].float()
                for prefix in (0, 2):
                    mine = head(supervised_hidden(model, ids, selected, prefix)).float()
                    if not close_enough(mine, full, tolerance):
                        log.debug("gpt2_supervised_rows: not used, its logits differ from the model's (shared prefix "
                                  "%d, attention %s)", prefix, base.config._attn_implementation)
                        return False
        return True
    except Exception as exc:  # any deviation from the expected structure: use the model's own forward
        log.debug("gpt2_supervised_rows: not used (%s: %s)", type(exc).__name__, exc)
        return False
    finally:
        model.train(was_training)


def _base(model: nn.Module) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def has_dropout(model: nn.Module) -> bool:
    """Any dropout with p > 0 in the model (adapters included): a dropout module, or the rate that
    attention applies itself in Llama-like models (``config.attention_dropout``); found once per model."""
    def find(m: nn.Module) -> bool:
        rate = getattr(getattr(_base(m), "config", None), "attention_dropout", 0.0)
        return (any(isinstance(module, nn.Dropout) and module.p > 0 for module in m.modules())
                or (isinstance(rate, float) and rate > 0))

    return remembered(model, "has_dropout", find)


def dropout_active(model: nn.Module) -> bool:
    return model.training and has_dropout(model)
