"""SmolLM2-135M LoRA training steps on CPU: SDPA or eager attention throughout, on short and on the longest rows.

What attention_by_width's limit (eager for batches of at most 256 tokens) rests on beyond GPT-2
(bench/probes/cpu_attention.py). W2 (bench/workloads.py: chat template, context + question -> answer, LoRA
r=16 on all projections, batch 8) runs 7 timed optimizer steps after one warm-up step in qatune's loop, in a
fresh process per arm, on two slices of the first 500 W2 rows: the first 64 (rows of 75-375 tokens) and the 64
with the longest context (up to 523 tokens). Each arm trains with the speed paths auto turns on here but
attention_by_width, and the model's attention set through transformers (``set_attn_implementation``) before
qatune sets up its loop. Prints non-padding tokens/s and peak RSS per arm and the ratio eager / SDPA.

    python bench/probes/smollm2_attention.py                     # ~5 minutes on 2 cores with native bf16
    python bench/probes/smollm2_attention.py --precision fp32    # ~10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import csv
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_machine import (
    alternating,
    child_result,
    describe,
    headline,
    json_option,
    print_result,
    results_path,
    write_json,
)
from workloads import need_shared_data, precision, training_device, w2_build, w2_overrides

STEM = "smollm2_attention"


def arm(attention: str, model: str, data: str, precision_: str) -> dict:
    from qatune.config import load_config
    from qatune.speedups import NAMES, auto_verdict
    from qatune.train import prepare, train_step
    from qatune.train.loop import Loop, windows

    paths = [name for name in NAMES if name != "attention_by_width"
             and auto_verdict(name, training_device(), precision_) is None]
    prepared = prepare(load_config(None, w2_overrides(model, data, precision_, 42, paths or "off")))
    base = prepared.model.get_base_model() if hasattr(prepared.model, "get_base_model") else prepared.model
    base.set_attn_implementation(attention)
    loop = Loop.setup(prepared, None, None)
    loop.start_epoch(0)
    batches = list(windows(loop.loader, 1))
    train_step(loop, batches[0])
    start, tokens = time.perf_counter(), 0
    for window in batches[1:8]:
        train_step(loop, window)
        tokens += int(window[0]["attention_mask"].sum())
    return {"attention": base.config._attn_implementation,
            "tokens_per_s": tokens / (time.perf_counter() - start), "longest_row": max(prepared.dataset.lengths),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "speedups": loop.speedups.describe()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds (each arm once per round)")
    parser.add_argument("--rows", type=int, default=64, help="rows per slice")
    json_option(parser, STEM)
    parser.add_argument("--arm", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.precision = precision(args.precision)
    if args.arm:
        print_result(arm(*args.arm, args.precision))
        return 0
    need_shared_data()
    info = describe()
    print(f"{headline(info)}; {args.precision}", flush=True)
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = w2_build(500, Path(tmp))
        with open(paths["data"], encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
        slices = {f"first {args.rows} rows": rows[:args.rows],
                  f"{args.rows} longest rows": sorted(rows, key=lambda r: len(r["context"]) + len(r["question"]))
                  [-args.rows:]}
        for name, picked in slices.items():
            data = Path(tmp) / f"{name.replace(' ', '_')}.csv"
            with open(data, "w", encoding="utf-8", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(picked[0]))
                writer.writeheader()
                writer.writerows(picked)
            results[name] = {"sdpa": [], "eager": []}
            for _, attention in alternating(args.rounds, ["sdpa", "eager"]):
                r = child_result([sys.executable, __file__, "--arm", attention, paths["model"], str(data),
                                  f"--precision={args.precision}"])
                results[name][attention].append(r)
                print(f"{name:16} {r['attention']:6} {r['tokens_per_s']:6.1f} tokens/s  "
                      f"longest row {r['longest_row']}  peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
            ratios = [e["tokens_per_s"] / s["tokens_per_s"] for s, e in zip(results[name]["sdpa"],
                                                                           results[name]["eager"])]
            print(f"{name:16} eager / sdpa: {', '.join(f'x{r:.2f}' for r in ratios)}", flush=True)
    suffix = f"_{args.precision}"
    write_json(args.json or results_path(STEM, suffix), {"machine": info, "precision": args.precision,
                                                         "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
