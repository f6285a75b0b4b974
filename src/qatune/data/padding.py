"""Padding shared by every batch qatune builds: the label that is not trained on, and padded id tensors."""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
"""Label of a position that is not trained on (padding, the prompt; a window without its answer's span).
PyTorch's cross-entropy skips it."""


def round_up(width: int, multiple: int) -> int:
    """``width`` rounded up to a multiple of ``multiple``."""
    return -(-width // multiple) * multiple


def bucket(width: int) -> int:
    """``width`` rounded up to one of a few sizes: a multiple of the largest power of two at most an eighth of it,
    so at most an eighth longer, and eight sizes an octave (..., 64, 72, ..., 120, 128, 144, ..., 480, 512, ...)."""
    return round_up(width, 1 << max(0, width.bit_length() - 4))


def batch_width(longest: int, multiple: int, limit: int | None, bucketed: bool = False) -> int:
    """What a batch is padded to: its longest row (``bucketed``: rounded up to one of few sizes, :func:`bucket`)
    rounded up to ``multiple``, but not past ``limit`` (the model's positions: a model with position embeddings
    cannot read a wider batch, even of padding)."""
    width = round_up(bucket(longest) if bucketed else longest, multiple)
    return max(longest, min(width, limit)) if limit else width


def left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask for batched generation."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        if prompt:
            input_ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[i, width - len(prompt):] = 1
    return input_ids, attention_mask


def right_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask (encoder inputs)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[i, : len(prompt)] = 1
    return input_ids, attention_mask
