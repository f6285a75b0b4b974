"""The last decoder layer's output projection and MLP on the supervised positions only (qatune.speedups.causal)
against the whole last layer, per training step of W2 (SmolLM2-135M-Instruct with LoRA, question + context
-> answer: rows of ~215 tokens, ~9 of them supervised; 30 layers) inside qatune's own loop.

One process, one model, set up as `qatune train` sets it up for W2 (bench/w2_smollm2_lora.py's config), in
fp32 (``--precision bf16`` on a CPU with native bf16). Every batch of the first ``--rows`` rows is trained
twice, alternating which goes first: once with the last layer on the supervised rows, once whole. Prints the
summed step times of both and their ratio per pass over the batches, and their median; and, from the first
batch, the summed loss both ways.

    python bench/last_layer_rows.py               # 3 passes over 6 batches, ~12 minutes on 2 cores in fp32
    python bench/last_layer_rows.py --rows 96 --passes 2
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

    args, info = per_batch_options(__doc__, __file__, more=lambda parser: parser.add_argument(
        "--precision", choices=["fp32", "bf16"], default="fp32"))
    prepared, loop = w2.qatune_loop(args.rows, f"train.precision={args.precision}", groups=False)
    objective = getattr(loop.objective, "module", loop.objective)
    print(f"loss: {objective.describe()}", flush=True)
    if not objective.last_rows:
        print("the last-layer rows do not apply to this model", file=sys.stderr)
        return 1

    def rows(on: bool):
        def shape(batch):
            objective.last_rows = on
            return batch
        return shape

    arms = [("last rows", rows(True)), ("whole", rows(False))]
    loop.start_epoch(0)
    batches = list(loop.loader)
    losses = w2.first_batch_losses(loop, batches[0], arms)
    passes, median, per_pass = timed_passes(batches, arms, lambda b: train_step(loop, [b]), args.passes)
    tokens = sum(len(item) for item in prepared.dataset.items)
    print(f"\nsteps with the last layer on the supervised rows are x{median:.3f} faster (median of {per_pass}); "
          f"precision {prepared.precision}, {len(batches)} batches, {tokens} tokens")
    objective.last_rows = True
    write_json(args.json, {"machine": info, "loss": objective.describe(), "rows": args.rows,
                           "precision": prepared.precision, "batches": len(batches), "tokens": tokens,
                           "first_batch_loss_sum": losses, "passes": passes, "median_ratio": median})
    return 0


if __name__ == "__main__":
    sys.exit(main())
