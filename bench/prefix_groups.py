"""Each group's prompt prefix computed once per batch (rows about one context: qatune.speedups.prefixes.plan)
against the batch's common prefix alone (the chat template's system prompt), per training step of W2
(SmolLM2-135M-Instruct, LoRA r=16 on all seven projections) inside qatune's own loop.

One process, one model, set up as `qatune train` sets it up for W2 (bench/w2_smollm2_lora.py's config): the
batches are those the loop trains on with rows about one context kept together (train.group_by_prefix:
true). Every
batch of the first ``--rows`` rows is trained twice, alternating which goes first: once with its group
prefixes, once with its common prefix only. Prints the summed step times of both, their ratio per pass over
the batches and their median, the token positions each arm computes, and the first batch's summed loss both
ways.

    python bench/prefix_groups.py               # 3 passes over 6 batches, ~8 minutes on 2 cores in fp32
    python bench/prefix_groups.py --rows 96 --passes 2
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench_machine import per_batch_options, timed_passes, write_json


def positions(batch: dict) -> tuple[int, int]:
    """Token positions the model computes for ``batch``: by groups, and with the common prefix only."""
    rows, width = batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1
    common = int(batch["shared_prefix"])
    alone = common + rows * (width - common)
    groups = batch["prefix_groups"]
    if groups is None:
        return alone, alone
    return len(groups["rows"]) * groups["prefix_width"] + rows * groups["suffix_width"], alone


def main() -> int:
    import w2_smollm2_lora as w2

    from qatune.train.loop import train_step

    args, info = per_batch_options(__doc__, __file__)
    prepared, loop = w2.qatune_loop(args.rows)
    objective = getattr(loop.objective, "module", loop.objective)
    print(f"loss: {objective.describe()}", flush=True)
    if not objective.groups:
        print("group prefixes do not apply to this model", file=sys.stderr)
        return 1
    loop.start_epoch(0)
    batches = list(loop.loader)
    grouped, common = (sum(counts) for counts in zip(*map(positions, batches), strict=True))
    planned = sum(b["prefix_groups"] is not None for b in batches)
    print(f"{len(batches)} batches, {planned} by groups; token positions computed: by groups {grouped}, common "
          f"prefix only {common} (x{common / grouped:.2f})", flush=True)
    arms = [("groups", lambda b: b), ("common prefix", lambda b: {**b, "prefix_groups": None})]
    losses = w2.first_batch_losses(loop, batches[0], arms)
    passes, median, per_pass = timed_passes(batches, arms, lambda b: train_step(loop, [b]), args.passes)
    tokens = sum(len(item) for item in prepared.dataset.items)
    print(f"\nsteps with each group's prefix once are x{median:.3f} faster (median of {per_pass}); precision "
          f"{prepared.precision}, {len(batches)} batches, {tokens} tokens")
    write_json(args.json, {"machine": info, "loss": objective.describe(), "rows": args.rows,
                           "precision": prepared.precision, "batches": len(batches), "batches_by_groups": planned,
                           "tokens": tokens, "positions": {"groups": grouped, "common prefix": common},
                           "first_batch_loss_sum": losses, "passes": passes, "median_ratio": median})
    return 0


if __name__ == "__main__":
    sys.exit(main())
