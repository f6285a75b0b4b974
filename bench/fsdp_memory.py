"""SmolLM2-135M, full fine-tuning on 2 CPU processes: one process vs DDP vs FSDP2, per-process peak memory (measured,
and as ``qatune check`` estimated it), tokens/s, and the loss after the same steps.

Each set-up trains configs/smollm2-qa.yaml on the first --rows rows of its training file (no validation, fp32, so
the losses compare) with the same global batch: one process with batch B and accumulation 2, two processes with
batch B each. Peak memory is each run's own measurement (run.json: the highest resident set of any of its
processes). FSDP is also run with glibc's malloc returning freed blocks to the system
(MALLOC_MMAP_THRESHOLD_=131072): its gather and reduce buffers, freed after every unit, otherwise stay in the
process's heap and hide the saving.

Writes bench/results/<this machine>/fsdp_memory.json.

    python bench/fsdp_memory.py                 # ~15 min on 2 cores
    python bench/fsdp_memory.py --rows 32 --json /tmp/fsdp.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may come from a model hub

from bench_machine import CHILD_ENV, ROOT, describe, headline, json_option, results_path, write_json

STEM = "fsdp_memory"
CONFIG = ROOT / "configs" / "smollm2-qa.yaml"
SETUPS = (
    # name, processes, --set, environment
    ("1 process", 1, ["train.gradient_accumulation_steps=2"], {}),
    ("ddp x 2", 2, ["train.distributed=ddp"], {}),
    ("fsdp x 2", 2, ["train.distributed=fsdp"], {}),
    ("fsdp x 2, malloc trimming", 2, ["train.distributed=fsdp"], {"MALLOC_MMAP_THRESHOLD_": "131072"}),
)


def qatune(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "qatune", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **CHILD_ENV, **env})
    if done.returncode != 0:
        raise SystemExit(f"qatune {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done


def estimates(common: list[str]) -> dict:
    done = qatune(["check", "--config", str(CONFIG), *common, "--processes", "2", "--json"], {})
    memory = json.loads(done.stdout)["memory"]
    return {s["setup"]: s for s in memory["setups"]} | {"_batch": memory["batch"]}


def train(name: str, processes: int, sets: list[str], env: dict[str, str], common: list[str], out: Path) -> dict:
    run = out / name.replace(" ", "_").replace(",", "")
    args = ["train", "--config", str(CONFIG), "--output-dir", str(run), "--quiet", *common,
            *[x for s in sets for x in ("--set", s)]]
    if processes > 1:
        args += ["--num-processes", str(processes)]
    start = time.perf_counter()
    done = qatune(args, env)
    seconds = time.perf_counter() - start
    result = json.loads((run / "run.json").read_text())["result"]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if x["event"] == "train"]
    sharding = next((line.split("fsdp: ", 1)[1] for line in done.stderr.splitlines() if "fsdp: " in line), None)
    measured = {
        "processes": processes, "sets": sets, "env": env, "wall_s": round(seconds, 1),
        "peak_memory_mib": result["peak_memory_mb"], "steps": result["steps"],
        "losses": [round(x["loss"], 5) for x in steps],
        "final_train_loss": round(result["final_train_loss"], 5),
        # the first step pays for warm-up (allocations, thread pools): left out of the rate
        "tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in steps[1:]), 1) if len(steps) > 1
        else None,
        "sharding": sharding,
    }
    print(f"{name:28s} peak {measured['peak_memory_mib'] / 1024:5.2f} GiB  {measured['tokens_per_s']} tok/s  "
          f"loss {measured['final_train_loss']}  ({seconds:.0f} s)", flush=True)
    shutil.rmtree(run, ignore_errors=True)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="training rows (default 64)")
    parser.add_argument("--batch", type=int, default=4, help="rows per process and micro-batch (default 4)")
    json_option(parser, STEM)
    args = parser.parse_args()
    machine = describe()
    print(headline(machine), flush=True)
    with tempfile.TemporaryDirectory(prefix="qatune-fsdp-bench-") as tmp:
        out = Path(tmp)
        rows = out / "rows.csv"
        import pandas as pd

        train_file = ROOT / "examples" / "data" / "squadshifts_qa.csv"
        pd.read_csv(train_file, keep_default_na=False).head(args.rows).to_csv(rows, index=False)
        common = ["--set", f"data.train_file={rows}", "--set", "data.eval_file=null", "--set",
                  "train.precision=fp32", "--set", f"train.batch_size={args.batch}", "--set", "train.epochs=1",
                  "--set", "train.logging_steps=1"]
        estimated = estimates(common)
        runs = {}
        for name, processes, sets, env in SETUPS:
            runs[name] = train(name, processes, sets, env, common, out)
            key = name.split(",")[0]
            runs[name]["estimated_gib"] = estimated[key]["total_gib"]
            runs[name]["estimated_parts_gib"] = estimated[key]["parts_gib"]
    result = {"machine": machine, "config": str(CONFIG.relative_to(ROOT)), "rows": args.rows,
              "batch_per_process": args.batch, "longest_batch": estimated["_batch"], "precision": "fp32",
              "runs": runs}
    write_json(args.json or results_path(STEM), result)


if __name__ == "__main__":
    main()
