"""A prompt prefix shared by every row of a batch (a chat template's system prompt) computed once and handed
to each row through the model's own key/value cache. What that saves on W2 (SmolLM2-135M-Instruct with LoRA,
question + context -> answer, the chat template: 24 shared tokens of ~215 per row), per training step inside
qatune's own loop.

One process, one model, set up as `qatune train` sets it up for W2 (bench/w2_smollm2_lora.py's config). Every
batch of the first ``--rows`` rows is trained twice, alternating which goes first: once as the collator made
it, once with its shared prefix set to 0, so that every row computes it. Prints the summed step times of both
and their ratio per pass over the batches, and their median; and, from the first batch, the loss both ways.

``--workload w1``: W1's GPT-2 instead (2 shared tokens, `Question:`, of ~21 per row), its lean path turned
off, so that it takes the cache path GPT-2 would take without its lean path: what a short prefix costs or
saves.

    python bench/shared_prefix_cache.py               # 3 passes over 6 batches, ~12 minutes on 2 cores in fp32
    python bench/shared_prefix_cache.py --rows 96 --passes 2
    python bench/shared_prefix_cache.py --workload w1 --rows 1000 --json bench/shared_prefix_cache_w1.json
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench_machine import W1_CONFIG, per_batch_options, timed_passes, write_json, write_nq_rows


def main() -> int:
    import w2_smollm2_lora as w2

    from qatune.config import load_config
    from qatune.train import prepare
    from qatune.train.loop import Loop, train_step

    args, info = per_batch_options(__doc__, __file__, more=lambda parser: parser.add_argument(
        "--workload", choices=["w2", "w1"], default="w2"))
    if args.workload == "w2":
        prepared, loop = w2.qatune_loop(args.rows, groups=False)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            data = write_nq_rows(w2.SHARED, args.rows, Path(tmp) / "nq.csv")
            config = Path(tmp) / "w1.yaml"
            config.write_text(W1_CONFIG.format(seed=42, data=data, precision="auto"), encoding="utf-8")
            prepared = prepare(load_config(config, []))
            prepared.model._qatune_lean_path = False  # as if the lean path had not matched: the cache path
            loop = Loop.setup(prepared, None, None)
    print(f"loss: {loop.objective.describe()}", flush=True)
    loop.start_epoch(0)
    batches = list(loop.loader)
    prefixes = [int(b["shared_prefix"]) for b in batches]
    arms = [("shared", lambda b: b), ("per row", lambda b: {**b, "shared_prefix": 0})]
    losses = w2.first_batch_losses(loop, batches[0], arms)
    passes, median, per_pass = timed_passes(batches, arms, lambda b: train_step(loop, [b]), args.passes)
    tokens = sum(len(item) for item in prepared.dataset.items)
    print(f"\nsteps with the prefix shared are x{median:.3f} faster (median of {per_pass}); precision "
          f"{prepared.precision}, {len(batches)} batches, shared prefixes {prefixes}, {tokens} tokens")
    write_json(args.json, {"machine": info, "workload": args.workload, "loss": loop.objective.describe(),
                           "rows": args.rows, "precision": prepared.precision,
                           "batches": len(batches), "shared_prefixes": prefixes, "tokens": tokens,
                           "first_batch_loss_sum": losses, "passes": passes, "median_ratio": median})
    return 0


if __name__ == "__main__":
    sys.exit(main())
