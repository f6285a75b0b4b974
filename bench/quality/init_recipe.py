"""What `qatune init` writes for SmolLM2 reading comprehension, over seeds: the newcomer's sheet (the 393 XQuAD rows
bench/ui_sheet_to_model.py drops on the page), the config init writes for it (`--task generative`, the packaged
SmolLM2, grounded), trained once per seed; each epoch's validation EM/F1 on the rows init holds out (10%, the
split drawn by the seed), and final/'s, which is what the page compares, serves and exports.

    python bench/quality/init_recipe.py                           # seeds 42 43 44, ~8 minutes each on 2 cores
    python bench/quality/init_recipe.py --set train.epochs=3 --json /tmp/three-epochs.json

Writes bench/results/<this machine>/init_recipe_rc.json.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_machine import CHILD_ENV, describe, headline, results_path, write_json
from ui_sheet_to_model import write_sheet
from workloads import need_shared_data

STEM = "init_recipe_rc"
ROWS = 393


def qatune(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "qatune", *args], check=True, env={**os.environ, **CHILD_ENV},
                   stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="KEY=VALUE beyond init's config")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    need_shared_data()
    info = describe()
    print(headline(info), flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sheet = work / "passages.csv"
        what = write_sheet("rc", ROWS, sheet)
        config = work / "passages.yaml"
        qatune("init", str(sheet), "--task", "generative", "--model", "smollm2-135m-instruct", "--output", str(config))
        written = config.read_text(encoding="utf-8")
        for seed in args.seeds:
            run = work / f"seed-{seed}"
            started = time.perf_counter()
            sets = [item for override in [f"seed={seed}", *args.overrides] for item in ("--set", override)]
            qatune("train", "--config", str(config), *sets, "--output-dir", str(run), "--quiet")
            seconds = time.perf_counter() - started
            lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
            evals = [{"epoch": e["epoch"], "exact_match": e["exact_match"], "f1": e["f1"]}
                     for e in lines if e.get("event") == "eval"]
            runs.append({"seed": seed, "seconds": round(seconds, 1), "epochs": evals, "final_f1": evals[-1]["f1"],
                         "final_exact_match": evals[-1]["exact_match"], "best_f1": max(e["f1"] for e in evals)})
            print(f"seed {seed}: " + ", ".join(f"epoch {e['epoch']} EM {e['exact_match']:.1f} F1 {e['f1']:.1f}"
                                               for e in evals) + f"  ({seconds:.0f} s)", flush=True)
    finals = [r["final_f1"] for r in runs]
    summary = {"final_f1_mean": round(statistics.mean(finals), 2), "final_f1_worst": min(finals)}
    print(f"final/ F1: mean {summary['final_f1_mean']}, worst {summary['final_f1_worst']}")
    write_json(args.json or results_path(STEM), {
        "benchmark": "init's SmolLM2 reading-comprehension config over seeds", "sheet": what, "rows": ROWS,
        "config": written, "overrides": args.overrides, "machine": info, "runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
