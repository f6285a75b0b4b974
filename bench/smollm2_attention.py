"""SmolLM2-135M LoRA training steps on CPU under bf16 (or fp32): SDPA or eager attention, on short and on the
longest rows.

What qatune.speedups.attention.EAGER_ATTENTION_MAX_TOKENS rests on beyond GPT-2 (bench/cpu_attention.py). The W2 setting
(bench/w2_smollm2_lora.py: chat template, context + question -> answer, LoRA r=16 on all projections,
batch 8, bf16) runs 7 timed optimizer steps after one warm-up step, in a fresh process per arm, on two
slices of the 500 W2 rows: the first 64 (rows of 75-375 tokens) and the 64 with the longest context
(up to 523 tokens). Prints non-padding tokens/s and peak RSS per arm.

With ``--precision fp32`` (the CPUs without native bf16, where qatune keeps SDPA) eager attention is set
on the model directly, since qatune switches to it only under bf16; the results go to
smollm2_attention_fp32.json.

    python bench/smollm2_attention.py          # ~5 minutes on 2 cores with native bf16
    python bench/smollm2_attention.py --precision fp32   # ~10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_machine import describe, headline  # bench/ is on sys.path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("QATUNE_SHARED_DATA", ROOT.parent / "shared" / "data"))
OUT = Path(__file__).with_suffix(".json")


def arm(attention: str, model: str, data: str, precision: str) -> dict:
    import w2_smollm2_lora as w2

    import qatune.speedups.attention
    from qatune.config import load_config
    from qatune.train.loop import Loop, train_step, windows
    from qatune.train.run import prepare_checked

    qatune.speedups.attention.EAGER_ATTENTION_MAX_TOKENS = 4096 if attention == "eager" else 0
    prepared = prepare_checked(load_config(None, [*w2.qatune_overrides(model, data), f"train.precision={precision}"]))
    if precision == "fp32" and attention == "eager":
        base = prepared.model.get_base_model() if hasattr(prepared.model, "get_base_model") else prepared.model
        base.set_attn_implementation("eager")
    loop = Loop.setup(prepared, None, None)
    loop.start_epoch(0)
    batches = list(windows(loop.loader, 1))
    train_step(loop, batches[0])
    start, tokens = time.perf_counter(), 0
    for window in batches[1:8]:
        train_step(loop, window)
        tokens += int(window[0]["attention_mask"].sum())
    return {"attention": prepared.model.config._attn_implementation,
            "tokens_per_s": tokens / (time.perf_counter() - start), "longest_row": max(prepared.dataset.lengths),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--arm", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print("RESULT " + json.dumps(arm(*args.arm, args.precision)), flush=True)
        return 0
    import w2_smollm2_lora as w2

    info = describe()
    print(f"{headline(info)}; {args.precision}", flush=True)
    out = OUT if args.precision == "bf16" else OUT.with_name(f"{OUT.stem}_fp32.json")
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        class Args:
            rows = 500

        paths = w2.setup(Args, Path(tmp))
        with open(paths["data"], encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
        slices = {"first 64 rows": rows[:64],
                  "64 longest rows": sorted(rows, key=lambda r: len(r["context"]) + len(r["question"]))[-64:]}
        for name, picked in slices.items():
            data = Path(tmp) / f"{name.replace(' ', '_')}.csv"
            with open(data, "w", encoding="utf-8", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(picked[0]))
                writer.writeheader()
                writer.writerows(picked)
            results[name] = {}
            for attention in ("sdpa", "eager"):
                done = subprocess.run([sys.executable, __file__, "--arm", attention, paths["model"], str(data),
                                       f"--precision={args.precision}"],
                                      capture_output=True, text=True, check=False, cwd=ROOT,
                                      env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
                line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return 1
                results[name][attention] = json.loads(line[len("RESULT "):])
                r = results[name][attention]
                print(f"{name:16} {r['attention']:6} {r['tokens_per_s']:6.1f} tokens/s  "
                      f"longest row {r['longest_row']}  peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
            print(f"{name:16} eager / sdpa: "
                  f"x{results[name]['eager']['tokens_per_s'] / results[name]['sdpa']['tokens_per_s']:.2f}", flush=True)
    out.write_text(json.dumps({"machine": info, "precision": args.precision, "results": results,
                               "measured": time.strftime("%Y-%m-%d %H:%M")}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
