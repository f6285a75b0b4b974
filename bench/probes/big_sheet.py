"""A big sheet: time and peak memory of `qatune check` and of reaching the first training step, from
20,000 to 200,000 rows. Both should grow linearly.

The sheet is made from ../shared/data/nq_open by repetition with changed numbers: copy k of a row gets
" (#k)" after its question and, when the answer holds a number, that number plus k; so every row is
distinct (nothing is dropped as a duplicate) and the tokenizer sees realistic text. The model is the
offline demo's (a small GPT-2 trained from scratch, its BPE tokenizer trained on the sheet). Each
measurement runs in a fresh process (clean peak RSS).

    python bench/probes/big_sheet.py               # 20k, 50k, 100k and 200k rows (~10 minutes)
    python bench/probes/big_sheet.py --rows 20000 200000
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_machine import CHILD_ENV, describe, headline, json_option, results_path, write_json
from workloads import SHARED, need_shared_data

STEM = "big_sheet"

CONFIG = """
model: {{scratch: {{n_layer: 2, n_embd: 128, n_head: 4, vocab_size: 4000}}}}
data: {{train_file: {data}}}
train: {{epochs: 1, batch_size: 32, precision: fp32}}
"""

CHILD = r"""
import json, os, resource, sys, time
t0 = time.perf_counter()
mode, config, out = sys.argv[1:4]
os.environ["HF_HUB_OFFLINE"] = "1"
from qatune.cli import main
if mode == "check":
    code = main(["check", "--config", config, "--json"])
    print(json.dumps({"seconds": time.perf_counter() - t0, "peak_rss_mb": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024, "exit": code}), file=sys.stderr)
else:
    import qatune.train.loop as loop
    real = loop.train_step
    def first(loop_state, window):
        real(loop_state, window)
        print(json.dumps({"seconds": time.perf_counter() - t0, "peak_rss_mb": resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss / 1024, "exit": 0}), file=sys.stderr)
        sys.stderr.flush()
        os._exit(0)
    loop.train_step = first
    main(["train", "--config", config, "--output-dir", out, "--quiet", "--overwrite"])
"""


def make_sheet(rows: int, path: Path) -> None:
    with open(SHARED / "nq_open" / "nq_open.csv", encoding="utf-8", newline="") as f:
        base = [(r["question"], r["answer"]) for r in csv.DictReader(f)]
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["question", "answer"])
        for i in range(rows):
            question, answer = base[i % len(base)]
            copy = i // len(base)
            if copy:
                question = f"{question} (#{copy})"
                answer = re.sub(r"\d+", lambda m, copy=copy: str(int(m.group()) + copy), answer, count=1)
            writer.writerow([question, answer])


def measure(mode: str, config: Path, out: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(config), str(out)], capture_output=True,
                          text=True, timeout=3600, check=False, env={**os.environ, **CHILD_ENV})
    lines = [line for line in done.stderr.splitlines() if line.startswith("{\"seconds\"")]
    if not lines:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[20_000, 50_000, 100_000, 200_000])
    json_option(parser, STEM)
    args = parser.parse_args()
    need_shared_data()
    machine = describe()
    print(headline(machine))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rows in args.rows:
            sheet = Path(tmp) / f"sheet-{rows}.csv"
            make_sheet(rows, sheet)
            config = Path(tmp) / f"config-{rows}.yaml"
            config.write_text(CONFIG.format(data=sheet), encoding="utf-8")
            check = measure("check", config, Path(tmp) / "run")
            first = measure("train", config, Path(tmp) / "run")
            results.append({"rows": rows, "check_s": check["seconds"], "check_peak_rss_mb": check["peak_rss_mb"],
                            "first_step_s": first["seconds"], "first_step_peak_rss_mb": first["peak_rss_mb"]})
            r = results[-1]
            print(f"{rows:>8} rows   check {r['check_s']:7.1f} s {r['check_peak_rss_mb']:7.0f} MB   "
                  f"first training step {r['first_step_s']:7.1f} s {r['first_step_peak_rss_mb']:7.0f} MB",
                  flush=True)
    small, big = results[0], results[-1]
    factor = big["rows"] / small["rows"]
    growth = {key: big[key] / small[key] for key in ("check_s", "first_step_s", "check_peak_rss_mb",
                                                      "first_step_peak_rss_mb")}
    print(f"{small['rows']} -> {big['rows']} rows (x{factor:.0f}): " +
          ", ".join(f"{key} x{value:.1f}" for key, value in growth.items()))
    write_json(args.json or results_path(STEM), {"machine": machine, "results": results, "growth": growth,
                                                 "rows_factor": factor})


if __name__ == "__main__":
    main()
