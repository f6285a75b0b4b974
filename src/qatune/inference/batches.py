"""How a trained model goes over many rows at inference: in batches of similar length, under the precision
generate.precision asks for."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext

import torch
from tqdm.auto import tqdm

from qatune.inference.lockstep import Lockstep, in_step


def inference_precision(precision: str, device: torch.device) -> AbstractContextManager:
    """bf16 autocast for ``generate.precision: bf16`` (and ``auto`` where bf16 is native); fp32 runs as it is."""
    if precision == "auto":
        from qatune.model.precision import resolve_precision

        precision = resolve_precision("auto", device.type)
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def length_sorted_batches(lengths: list[int], batch_size: int, progress: bool, desc: str,
                           lockstep: Lockstep | None = None) -> Iterator[tuple[list[int], bool]]:
    """``(indices, mine)``: indices in batches of similar length (less padding; callers put results back in
    order), each ``mine``; with a ``lockstep``, then repeats of the last batch (not ``mine``) up to the number of
    batches of the process with the most."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    with tqdm(total=len(lengths), desc=desc, unit="row", disable=not progress, leave=False) as bar:
        for chunk, mine in in_step(chunks, lockstep, []):
            yield chunk, mine
            if mine:
                bar.update(len(chunk))  # rows done: what the page's bar counts
