"""Each layer's projections and MLP on the real tokens only (qatune.speedups.causal, ``unpadded``) against the
padded rows, per training step of W2 (SmolLM2-135M-Instruct with LoRA r=16 on all seven projections, question
+ context -> answer; 30 layers) inside qatune's own loop.

One process, one model, set up as `qatune train` sets it up for W2 (bench/w2_smollm2_lora.py's config, its
defaults: length-grouped batches, the batch's common prefix or each group's computed once), in fp32
(``--precision bf16`` on a CPU with native bf16). Every batch of the first ``--rows`` rows is trained twice,
alternating which goes first: once with the position-wise work on the real tokens, once on every position of
the padded rows. Prints the token positions the matrix products see both ways, the summed step times of
both and their ratio per pass over the batches, and their median; and, from the first batch, the summed
loss both ways.

    python bench/unpadded_rows.py               # 3 passes over 8 batches, ~15 minutes on 2 cores in fp32
    python bench/unpadded_rows.py --rows 128 --passes 2
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench_machine import per_batch_options, timed_passes, write_json


def positions(batch) -> tuple[int, int]:
    """(padded, real) token positions of the forwards after the shared prefixes, as lean_causal runs them."""
    mask = batch["attention_mask"][:, :-1]  # the objective leaves the last column out
    groups = batch.get("prefix_groups")
    if groups is not None:
        lengths = groups["lengths"]
        rest = mask.sum(1) - lengths[groups["group"]]
        return (lengths.numel() * groups["prefix_width"] + mask.shape[0] * groups["suffix_width"],
                int(lengths.sum()) + int(rest.clamp(min=0).sum()))
    prefix = batch.get("shared_prefix", 0)
    rest = mask[:, prefix:]
    return prefix + rest.numel(), prefix + int(rest.sum())


def main() -> int:
    import w2_smollm2_lora as w2

    from qatune.train.loop import train_step

    args, info = per_batch_options(__doc__, __file__, rows=64, more=lambda parser: parser.add_argument(
        "--precision", choices=["fp32", "bf16"], default="fp32"))
    prepared, loop = w2.qatune_loop(args.rows, f"train.precision={args.precision}", groups=False)
    objective = getattr(loop.objective, "module", loop.objective)
    objective.groups = objective.paths.get("groups", False)  # W2's defaults: each group's prefix where it pays
    print(f"loss: {objective.describe()}", flush=True)
    if not objective.unpadded:
        print("the unpadded position-wise work does not apply to this model", file=sys.stderr)
        return 1

    def unpadded(on: bool):
        def shape(batch):
            objective.unpadded = on
            return batch
        return shape

    arms = [("unpadded", unpadded(True)), ("padded", unpadded(False))]
    loop.start_epoch(0)
    batches = list(loop.loader)
    padded, real = map(sum, zip(*(positions(batch) for batch in batches)))
    print(f"token positions in the forwards: {padded} padded, {real} real ({1 - real / padded:.1%} padding)",
          flush=True)
    losses = w2.first_batch_losses(loop, batches[0], arms)
    passes, median, per_pass = timed_passes(batches, arms, lambda b: train_step(loop, [b]), args.passes)
    tokens = sum(len(item) for item in prepared.dataset.items)
    print(f"\nsteps with the position-wise work on the real tokens are x{median:.3f} faster (median of {per_pass}); "
          f"precision {prepared.precision}, {len(batches)} batches, {tokens} tokens")
    objective.unpadded = True
    write_json(args.json, {"machine": info, "loss": objective.describe(), "rows": args.rows,
                           "precision": prepared.precision, "batches": len(batches), "tokens": tokens,
                           "positions": {"padded": padded, "real": real}, "first_batch_loss_sum": losses,
                           "passes": passes, "median_ratio": median})
    return 0


if __name__ == "__main__":
    sys.exit(main())
