"""Attention chosen per batch by its width (qatune.speedups.attention.AttentionByWidth: eager up to
EAGER_ATTENTION_MAX_TOKENS tokens, SDPA beyond) against SDPA throughout, per training step of W2
(SmolLM2-135M-Instruct with LoRA r=16 on all seven projections, question + context -> answer) inside qatune's
own loop, under bf16 on a CPU with native bf16.

W2's rows reach 523 tokens, so a choice made once for the run (as qatune made it before: eager only when no
row is longer than 256 tokens) kept SDPA for every batch; its CPU backward under bf16 runs one small oneDNN
product per block and head. One process, one model, set up as `qatune train` sets it up for W2
(bench/w2_smollm2_lora.py's config, its defaults). Every batch of the first ``--rows`` rows is trained twice,
alternating which goes first: once with the attention its width picks, once with SDPA. Prints each batch's
width and what it picked, the summed step times of both and their ratio per pass over the batches, and their
median; and, from the first batch, the summed loss both ways.

    python bench/attention_by_width.py               # 3 passes over 12 batches, ~6 minutes on 2 cores in bf16
    python bench/attention_by_width.py --rows 200 --passes 2
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench_machine import per_batch_options, timed_passes, write_json


def main() -> int:
    import w2_smollm2_lora as w2

    from qatune.train.loop import train_step

    args, info = per_batch_options(__doc__, __file__, rows=96)
    prepared, loop = w2.qatune_loop(args.rows, "train.precision=bf16", groups=False)
    objective = getattr(loop.objective, "module", loop.objective)
    objective.groups = objective.paths.get("groups", False)  # W2's defaults: each group's prefix where it pays
    switch = loop.attention
    if switch is None:
        print("no per-batch attention switch here (it applies under bf16 on CPU, to a model on SDPA)",
              file=sys.stderr)
        return 1
    print(f"loss: {objective.describe()}", flush=True)

    def by_width(on: bool):
        def shape(batch):
            loop.attention = switch if on else None
            switch.use(batch["input_ids"].shape[1] if on else 10**9)  # 10**9: wider than any eager limit, SDPA
            return batch
        return shape

    arms = [("by width", by_width(True)), ("sdpa", by_width(False))]
    loop.start_epoch(0)
    batches = list(loop.loader)
    widths = [int(batch["input_ids"].shape[1]) for batch in batches]
    picked = [switch.choice(width) for width in widths]
    print("batch widths: " + ", ".join(f"{w} ({p})" for w, p in zip(widths, picked)), flush=True)
    losses = w2.first_batch_losses(loop, batches[0], arms)
    passes, median, per_pass = timed_passes(batches, arms, lambda b: train_step(loop, [b]), args.passes)
    loop.attention = switch
    tokens = sum(len(item) for item in prepared.dataset.items)
    print(f"\nsteps with the attention picked by width are x{median:.3f} faster than SDPA throughout (median of "
          f"{per_pass}); precision {prepared.precision}, {len(batches)} batches, {picked.count('eager')} of them "
          f"eager, {tokens} tokens")
    write_json(args.json, {"machine": info, "loss": objective.describe(), "rows": args.rows,
                           "precision": prepared.precision, "batches": len(batches), "tokens": tokens,
                           "widths": widths, "picked": picked, "first_batch_loss_sum": losses,
                           "passes": passes, "median_ratio": median})
    return 0


if __name__ == "__main__":
    sys.exit(main())
