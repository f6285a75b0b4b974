"""Is GPT-2's lean loss path (qatune.speedups.gpt2) worth it in each precision? The loop's time on W1-shaped
work with the lean path on and off, in fp32 and in bf16 (bf16 weights, fp32 masters, eager attention on
these short rows), alternating in fresh processes. Prints each round's ratio and their median.

    python bench/lean_precision.py            # 320 NQ-open rows, GPT-2 6x512x8, batch 16, 2 rounds
    python bench/lean_precision.py --precision bf16 --rounds 5 --json bench/lean_precision_amd_bf16.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_machine import describe, headline, json_option, write_nq_rows  # bench/ is on sys.path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("QATUNE_SHARED_DATA", ROOT.parent / "shared" / "data"))

CHILD = r"""
import os, sys, time
os.environ["HF_HUB_OFFLINE"] = "1"
from qatune.config import load_config
from qatune.train import prepare, fit
import qatune.model.objectives as objectives
data, precision, lean = sys.argv[1], sys.argv[2], sys.argv[3] == "on"
real = objectives.objective_for
objective_for = lambda task, model: real(task, model, lean=lean)
import qatune.train.loop as loop
loop.objective_for = objective_for
config = load_config(None, ["model.scratch.n_layer=6", "model.scratch.n_embd=512", "model.scratch.n_head=8",
    "model.scratch.vocab_size=4096", "model.scratch.n_positions=256", f"data.train_file={data}", "train.epochs=1",
    "train.batch_size=16", "train.learning_rate=5e-4", "train.weight_decay=0", f"train.precision={precision}"])
prepared = prepare(config)
start = time.perf_counter()
fit(prepared, None, progress=False)
print("SECONDS", time.perf_counter() - start)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=320)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--precision", choices=["fp32", "bf16", "both"], default="both")
    json_option(parser, __file__)
    args = parser.parse_args()
    precisions = ("fp32", "bf16") if args.precision == "both" else (args.precision,)
    machine = describe()
    print(headline(machine), flush=True)
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_nq_rows(SHARED, args.rows, Path(tmp) / "nq.csv")
        for round_ in range(args.rounds):
            for precision in precisions:
                for lean in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
                    done = subprocess.run([sys.executable, "-c", CHILD, str(data), precision, lean],
                                          capture_output=True, text=True, cwd=ROOT, check=False)
                    line = next((x for x in done.stdout.splitlines() if x.startswith("SECONDS")), None)
                    if line is None:
                        print(done.stderr[-3000:], file=sys.stderr)
                        return 1
                    seconds = float(line.split()[1])
                    times.setdefault(f"{precision} lean {lean}", []).append(seconds)
                    print(f"round {round_ + 1} {precision} lean path {lean:3}: {seconds:6.1f} s", flush=True)
                ratio = times[f"{precision} lean off"][-1] / times[f"{precision} lean on"][-1]
                print(f"round {round_ + 1} {precision}: lean path x{ratio:.3f}", flush=True)
    summary = {key: statistics.median(values) for key, values in times.items()}
    ratios = {}
    for precision in precisions:
        ratios[precision] = [off / on for on, off in zip(times[f"{precision} lean on"], times[f"{precision} lean off"])]
        print(f"{precision}: lean path {', '.join(f'x{r:.3f}' for r in ratios[precision])} per round (loop time "
              f"without it / with it), median x{statistics.median(ratios[precision]):.3f}")
    args.json.write_text(json.dumps({"machine": machine, "rows": args.rows, "times": times, "median_seconds": summary,
                                     "ratios": ratios, "median_ratio": {p: statistics.median(r) for p, r in
                                                                        ratios.items()},
                                     "measured": time.strftime("%Y-%m-%d %H:%M")}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
