"""Is GPT-2's lean loss path (qatune.lean_gpt2) worth it in each precision? The loop's time on W1-shaped
work with the lean path on and off, in fp32 and in bf16 autocast, alternating in fresh processes.

    python bench/lean_precision.py            # 320 NQ-open rows, GPT-2 6x512x8, batch 16, 2 rounds
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

from bench_machine import describe, headline, write_nq_rows  # bench/ is on sys.path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("QATUNE_SHARED_DATA", ROOT.parent / "shared" / "data"))
OUT = Path(__file__).with_suffix(".json")

CHILD = r"""
import os, sys, time
os.environ["HF_HUB_OFFLINE"] = "1"
from qatune.config import load_config
from qatune.train import prepare, fit
import qatune.objectives as objectives
data, precision, lean = sys.argv[1], sys.argv[2], sys.argv[3] == "on"
real = objectives.objective_for
objective_for = lambda task, model, p="fp32": real(task, model, "fp32" if lean else "off")
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
    args = parser.parse_args()
    machine = describe()
    print(headline(machine), flush=True)
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_nq_rows(SHARED, args.rows, Path(tmp) / "nq.csv")
        for round_ in range(args.rounds):
            for precision in ("fp32", "bf16"):
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
    summary = {key: statistics.median(values) for key, values in times.items()}
    for precision in ("fp32", "bf16"):
        ratio = summary[f"{precision} lean off"] / summary[f"{precision} lean on"]
        print(f"{precision}: lean path x{ratio:.2f} (loop time without it / with it, median of {args.rounds})")
    OUT.write_text(json.dumps({"machine": machine, "rows": args.rows, "times": times, "median_seconds": summary,
                               "measured": time.strftime("%Y-%m-%d %H:%M")}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
