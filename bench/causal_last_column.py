"""Causal training leaves each batch's last column out of the forward (it predicts nothing, and no other
position reads it). What that saves on W1, measured per training step inside qatune's own loop.

One process, one model: the loop is set up as `qatune train` sets it up (malloc keeping freed memory, the
GPT-2 lean path, bf16 masters where bf16 is native), and every batch of the epoch is trained twice,
alternating which goes first: once as the collator made it, once with one more padding column, which the
objective's cut then removes, so that the model computes the width it computed before the change. Prints
the summed step times of both and their ratio per pass over the batches, and their median.

    python bench/causal_last_column.py               # 2 passes over W1's 63 batches, ~3 minutes on 2 cores
    python bench/causal_last_column.py --passes 4 --rows 500
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from bench_machine import W1_CONFIG, per_batch_options, timed_passes, write_json, write_nq_rows

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("QATUNE_SHARED_DATA", ROOT.parent / "shared" / "data"))


def with_last_column(batch: dict) -> dict:
    """The batch one padding column wider: the objective's cut leaves the width it had before."""
    wider = dict(batch)
    for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", -100)):
        tensor = batch[key]
        wider[key] = torch.cat([tensor, tensor.new_full((tensor.shape[0], 1), fill)], dim=1)
    return wider


def main() -> int:
    from qatune.config import load_config
    from qatune.train import prepare
    from qatune.train.loop import Loop, train_step

    args, info = per_batch_options(__doc__, __file__, rows=1000, passes=2)
    with tempfile.TemporaryDirectory() as tmp:
        data = write_nq_rows(SHARED, args.rows, Path(tmp) / "nq.csv")
        config = Path(tmp) / "w1.yaml"
        config.write_text(W1_CONFIG.format(seed=42, data=data, precision="auto"), encoding="utf-8")
        prepared = prepare(load_config(config, []))
    loop = Loop.setup(prepared, None, None)
    loop.start_epoch(0)
    batches = list(loop.loader)
    for batch in batches[:3]:  # warm-up: first calls of every kernel
        train_step(loop, [batch])
    arms = [("left out", lambda b: b), ("computed", with_last_column)]
    passes, median, per_pass = timed_passes(batches, arms, lambda b: train_step(loop, [b]), args.passes)
    print(f"\nsteps with the last column left out are x{median:.3f} faster (median of {per_pass}); precision "
          f"{prepared.precision}, {len(batches)} batches")
    write_json(args.json, {"machine": info, "rows": args.rows, "precision": prepared.precision,
                           "batches": len(batches), "passes": passes, "median_ratio": median})
    return 0


if __name__ == "__main__":
    sys.exit(main())
