"""Memory over epochs: each shipped config trained for several epochs, the process's peak at the end of every epoch
(metrics.jsonl's peak_memory_mb, and rss_mb where the run logs it) against what ``qatune check`` estimated. An
epoch's peak counts its validation (the config's held-out rows, answered after the epoch), where the run logs it.

An epoch after the first sees the same rows: its peak should stay where the first epoch's was. Each config trains on
the first --rows rows of its own files (fewer for SmolLM2, whose steps are slow), in a fresh process per arm, one
arm after another (never two at once).

    python bench/memory_epochs.py                                   # every config, bf16 where native and fp32
    python bench/memory_epochs.py --configs minilm-scoring --precisions fp32 --epochs 5
    python bench/memory_epochs.py --src /tmp/before/src --json /tmp/before.json    # another checkout's qatune

Writes bench/results/<this machine>/memory_epochs.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may come from a model hub

from bench_machine import CHILD_ENV, ROOT, describe, headline, json_option, native_bf16, results_path, write_json

STEM = "memory_epochs"
CONFIGS = {
    # config: (training rows, held-out rows); None keeps the file whole
    "minilm-scoring": (None, 100),
    "minilm-extractive": (320, 40),
    "smollm2-qa": (160, 16),
    "smollm2-demo": (160, None),
    "tiny-gpt2": (None, None),
}


def first_rows(path: Path, rows: int | None, out: Path) -> Path:
    if rows is None:
        return path
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header, picked = next(reader), [row for _, row in zip(range(rows), reader)]
    with open(out, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(picked)
    return out


def qatune(args: list[str], src: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **CHILD_ENV, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, "-m", "qatune", *args], capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise SystemExit(f"qatune {' '.join(args[:3])} failed:\n{done.stderr[-3000:]}")
    return done


def settings(name: str, precision: str, speedups: str, epochs: int, work: Path) -> list[str]:
    """--set items: the config's own files cut to its rows, the epochs, one log line per step."""
    import yaml

    raw = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text(encoding="utf-8"))
    train_rows, eval_rows = CONFIGS[name]
    data = raw.get("data", {})
    train = first_rows(ROOT / data["train_file"], train_rows, work / f"{name}-train.csv")
    sets = [f"data.train_file={train}", f"train.epochs={epochs}", "train.logging_steps=1",
            f"train.precision={precision}", f"train.speedups={speedups}"]
    if data.get("eval_file"):
        sets.append(f"data.eval_file={first_rows(ROOT / data['eval_file'], eval_rows, work / f'{name}-eval.csv')}")
    return [item for value in sets for item in ("--set", value)]


def arm(name: str, precision: str, speedups: str, epochs: int, src: Path, work: Path, per_step: bool = False) -> dict:
    sets = settings(name, precision, speedups, epochs, work)
    config = str(ROOT / "configs" / f"{name}.yaml")
    check = json.loads(qatune(["check", "--config", config, *sets, "--json"], src).stdout)
    memory = check["memory"]
    estimate = next(s for s in memory["setups"] if s["setup"] == "1 process")
    run = work / f"{name}-{precision}-{speedups}"
    started = time.perf_counter()
    qatune(["train", "--config", config, *sets, "--output-dir", str(run), "--overwrite", "--quiet"], src)
    seconds = time.perf_counter() - started
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    train = [line for line in lines if line.get("event") == "train"]
    per_epoch: dict[int, dict] = {}
    for line in train:
        epoch = per_epoch.setdefault(line["epoch"], {"peak_mb": 0.0, "rss_mb": []})
        epoch["peak_mb"] = max(epoch["peak_mb"], line["peak_memory_mb"])
        if "rss_mb" in line:
            epoch["rss_mb"].append(line["rss_mb"])
    for line in lines:   # validation after an epoch: its eval line's epoch counts the epochs done
        if line.get("event") == "eval" and "peak_memory_mb" in line and line["epoch"] in per_epoch:
            epoch = per_epoch[line["epoch"]]
            epoch["peak_mb"] = max(epoch["peak_mb"], line["peak_memory_mb"])
    result = json.loads((run / "run.json").read_text(encoding="utf-8")).get("result", {})
    shutil.rmtree(run)  # its checkpoints: several GB for a SmolLM2 run, ten arms in one folder fill a disk
    epochs_out = [{"epoch": k, "peak_mb": v["peak_mb"],
                   **({"rss_end_mb": v["rss_mb"][-1], "rss_max_mb": max(v["rss_mb"])} if v["rss_mb"] else {})}
                  for k, v in sorted(per_epoch.items())]
    first, last = epochs_out[0]["peak_mb"], epochs_out[-1]["peak_mb"]
    warnings = [line["message"] for line in lines if line.get("event") == "memory_warning"]
    return {"config": name, "precision": precision, "speedups": speedups, "steps": len(train),
            "estimate_gib": estimate["total_gib"], "estimate_parts_gib": estimate["parts_gib"],
            "batch": memory["batch"], "epochs": epochs_out, "epoch1_peak_mb": first, "last_epoch_peak_mb": last,
            "last_over_first": round(last / first, 3), "run_peak_mb": result.get("peak_memory_mb"),
            "estimate_over_peak": round(estimate["total_gib"] * 1024 / max(last, 1.0), 3),
            "memory_warnings": warnings, "train_seconds": round(seconds, 1),
            "estimated_train_seconds": (check.get("training_time") or {}).get("seconds"),
            **({"steps": [{"epoch": line["epoch"], "step": line["step"], "peak_mb": line["peak_memory_mb"],
                           "rss_mb": line.get("rss_mb")} for line in train],
                "validations": [{"epoch": line["epoch"], "peak_mb": line["peak_memory_mb"]} for line in lines
                                if line.get("event") == "eval" and "peak_memory_mb" in line]} if per_step else {})}


def heap_policy() -> dict:
    """The heap's trimming where the environment changes it for the runs (qatune.train.heap.TRIM_EVERY_STEP)."""
    return {"heap_trim": "after every update"} if os.environ.get("QATUNE_TRIM_EVERY_STEP") == "1" else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--precisions", nargs="+", default=None, choices=["bf16", "fp32"],
                        help="default: bf16 (where native) and fp32")
    parser.add_argument("--speedups", nargs="+", default=["auto"], choices=["auto", "off"])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--per-step", action="store_true",
                        help="keep every step's peak and resident set (and each validation's peak) in the JSON")
    parser.add_argument("--src", type=Path, default=ROOT / "src", help="the qatune source to run (another checkout's)")
    json_option(parser, STEM)
    args = parser.parse_args()
    precisions = args.precisions or (["bf16", "fp32"] if native_bf16() else ["fp32"])
    info = describe()
    print(headline(info), flush=True)
    commit = subprocess.run(["git", "-C", str(args.src), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    results = []
    with tempfile.TemporaryDirectory(prefix="qatune-memory-") as folder:
        for name in args.configs:
            for precision in precisions:
                for speedups in args.speedups:
                    found = arm(name, precision, speedups, args.epochs, args.src, Path(folder), args.per_step)
                    results.append(found)
                    write_json(args.json or results_path(STEM), {   # after every arm: a failed arm keeps the others
                        "machine": info, "src": str(args.src), "commit": commit, "epochs": args.epochs,
                        "rows": CONFIGS, **heap_policy(), "results": results})
                    print(f"{name:18} {precision:5} {speedups:5} epoch peaks (MB): "
                          f"{[e['peak_mb'] for e in found['epochs']]}  last/first x{found['last_over_first']}  "
                          f"estimate {found['estimate_gib']:.2f} GiB (x{found['estimate_over_peak']} of the peak)  "
                          f"{found['train_seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
