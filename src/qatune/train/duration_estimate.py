"""How long will it take? A training's wall time on this machine, estimated before anything is trained (``qatune
check``, the page's Check step), from the arithmetic its batches need and a matrix product timed on the spot.

Per epoch: the model's matrix products over the batches the data makes (length-grouped, as training groups them):
about 6 x weights per token for full fine-tuning (forward, then gradients of activations and of weights), 4 x for
LoRA (no weight gradients for the frozen ones), and attention's 12 x layers x hidden x width per token; plus
AdamW's update of the trained weights, which reads and writes memory rather than computing. Validation: the
validation rows' prompts read once and their answers written token by token. The rate is a square matrix product in
the precision training uses, timed for a fraction of a second, times what a training step reaches of it
(MATMUL_SHARE, measured). It says "about": steps of tiny models are mostly Python, and another program on the
machine slows everything down.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

MATMUL_SHARE = 0.45
"""The share of a square matrix product's rate that a training step's products reach on a CPU (transposes, small
matrices, element-wise work between them); measured on the shipped configs (bench/memory_epochs.py records each run's
time beside this estimate)."""
STEP_OVERHEAD_S = 0.02
"""Python and dispatch per optimizer step: what a tiny model's step costs however small."""
TOKEN_OVERHEAD_S = 0.004
"""Per generated token of a validation batch: one decoding step's dispatch."""
MEMORY_BYTES_PER_S = 8e9
"""What AdamW's update streams through memory per second (it reads and writes ~16 bytes per trained weight in fp32,
twice that with bf16 master weights)."""


def matmul_rate(dtype: torch.dtype, device: str = "cpu", size: int = 1024) -> float:
    """FLOP/s of a size^3 matrix product in ``dtype`` on ``device`` (best of a few, after a warm-up)."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    a @ b
    best = math.inf
    for _ in range(4):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / max(best, 1e-9)


def training_seconds(model: torch.nn.Module, widths: list[tuple[int, int]], epochs: int, lora: bool,
                     eval_rows: list[tuple[int, int]], rate: float, layers: int, hidden: int,
                     head_tokens: int = 0) -> dict[str, Any]:
    """The estimate: ``widths``, one epoch's batches as (rows, width); ``eval_rows``, the validation rows as (prompt
    tokens, answer tokens to write: 0 for a model that does not write its answer); ``rate``, FLOP/s reached;
    ``head_tokens``: the positions an epoch runs a language model's head on (its vocabulary's product)."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    looked_up = sum(p.numel() for p in embedding.parameters()) if embedding is not None else 0
    products = total - looked_up  # the input embedding is a lookup; a language model's head is counted apart
    per_token = (4 if lora else 6) * products
    flops = sum(rows * width * (per_token + 12 * layers * hidden * width) for rows, width in widths)
    flops += 6 * looked_up * head_tokens
    steps = len(widths)
    update = steps * trained * 16 / MEMORY_BYTES_PER_S
    epoch = flops / rate + update + steps * STEP_OVERHEAD_S
    validation = sum(2 * products * (prompt + answer) for prompt, answer in eval_rows) / rate
    validation += sum(answer for _, answer in eval_rows) * TOKEN_OVERHEAD_S / max(1, min(len(eval_rows), 32))
    seconds = epochs * (epoch + validation)
    return {"seconds": round(seconds, 1), "epoch_seconds": round(epoch, 1),
            "validation_seconds": round(validation, 1), "tflops_per_epoch": round(flops / 1e12, 2)}


def batch_widths(lengths: list[int], batch_size: int) -> list[tuple[int, int]]:
    """One epoch's batches as training makes them, grouped by length: (rows, longest row)."""
    ordered = sorted(lengths)
    return [(len(chunk), max(chunk)) for chunk in (ordered[i:i + batch_size]
                                                   for i in range(0, len(ordered), batch_size))]
