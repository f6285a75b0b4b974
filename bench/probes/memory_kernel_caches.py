"""Where a bf16 training's memory goes on a CPU, step by step: one setting changed per arm, each run's per-step
resident set (metrics.jsonl's ``rss_mb``, after the step) and high-water mark (``peak_memory_mb``).

The arms train configs/minilm-scoring.yaml (bf16, train.speedups auto, its 240 training rows, its first 100 held-out
rows, 2 epochs of 15 steps, one log line per step) from a checkout of ``--commit``, where the heaviest batch is the
second update:

    A  as shipped                         E  MALLOC_MMAP_THRESHOLD_=131072 (glibc maps large blocks afresh)
    B  data.eval_file=null                F  D and E
    C  train.ema_decay=null               G  F and LRU_CACHE_CAPACITY=1 (ideep's cache off too)
    D  ONEDNN_PRIMITIVE_CACHE_CAPACITY=0  (oneDNN's primitive cache off)

``timing`` times A as a whole process, alternating, with both kernel caches on and off. ``after`` trains, from a
checkout of ``--after-commit`` (every epoch ends with its heaviest batch, the heap trimmed before it), 2 epochs of
configs/smollm2-qa.yaml on 160 rows with 16 held-out (Q1) and without validation (Q2), and of
configs/minilm-extractive.yaml on 320 rows with 40 held-out (X1) and without (X2).

Each checkout is a temporary `git worktree` (its own configs, data and src/), removed afterwards; every run is a
fresh process, one after another.

    python bench/probes/memory_kernel_caches.py                                  # all of it: ~16 min on 2 cores
    python bench/probes/memory_kernel_caches.py --arms A E --after X2 --timing-rounds 0 --json /tmp/k.json

Writes bench/results/<this machine>/memory_kernel_caches.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_machine import CHILD_ENV, ROOT, alternating, describe, headline, json_option, results_path, write_json
from memory_epochs import first_rows

STEM = "memory_kernel_caches"
SCORER = ("minilm-scoring", None, 100)
"""config, training rows, held-out rows (None: the whole file)"""
CACHES_OFF = {"LRU_CACHE_CAPACITY": "1", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}
ARMS: dict[str, dict] = {
    "A": {},
    "B": {"set": "data.eval_file=null"},
    "C": {"set": "train.ema_decay=null"},
    "D": {"env": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}},
    "E": {"env": {"MALLOC_MMAP_THRESHOLD_": "131072"}},
    "F": {"env": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "MALLOC_MMAP_THRESHOLD_": "131072"}},
    "G": {"env": {"LRU_CACHE_CAPACITY": "1", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
                  "MALLOC_MMAP_THRESHOLD_": "131072"}},
}
AFTER = {  # config, training rows, held-out rows (None: no validation)
    "Q1": ("smollm2-qa", 160, 16),
    "Q2": ("smollm2-qa", 160, None),
    "X1": ("minilm-extractive", 320, 40),
    "X2": ("minilm-extractive", 320, None),
}
EPOCHS = 2


@contextmanager
def checkout(commit: str) -> Iterator[Path]:
    """A worktree of ``commit`` in a temporary folder, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="qatune-kernel-caches-") as folder:
        tree = Path(folder) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True,
                       capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True,
                           capture_output=True)


def settings(tree: Path, name: str, train_rows: int | None, eval_rows: int | None, work: Path) -> list[str]:
    """--set items: the config's own files cut to their first rows (no held-out file where ``eval_rows`` is
    None), bf16, speedups auto, the epochs, one log line per step."""
    import yaml

    data = yaml.safe_load((tree / "configs" / f"{name}.yaml").read_text(encoding="utf-8"))["data"]
    train = first_rows(tree / data["train_file"], train_rows, work / f"{name}-train.csv")
    held_out = (f"data.eval_file={first_rows(tree / data['eval_file'], eval_rows, work / f'{name}-eval.csv')}"
                if eval_rows else "data.eval_file=null")
    return [f"data.train_file={train}", held_out, f"train.epochs={EPOCHS}", "train.logging_steps=1",
            "train.precision=bf16", "train.speedups=auto"]


def with_setting(sets: list[str], setting: str) -> list[str]:
    """``sets`` with ``setting`` (key=value) in place of any value the key had."""
    key = setting.split("=", 1)[0] + "="
    return [s for s in sets if not s.startswith(key)] + [setting]


def train(tree: Path, name: str, sets: list[str], env: dict[str, str], run: Path) -> tuple[list[dict], float]:
    """One `qatune train` from ``tree`` in a fresh process: its steps (epoch, step, peak_mb, rss_mb) and seconds."""
    command = [sys.executable, "-m", "qatune", "train", "--config", str(tree / "configs" / f"{name}.yaml"),
               *[item for value in sets for item in ("--set", value)], "--output-dir", str(run), "--overwrite",
               "--quiet"]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=tree,
                          env={**os.environ, **CHILD_ENV, "PYTHONPATH": str(tree / "src"), **env})
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"qatune train {name} failed:\n{done.stderr[-3000:]}")
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    shutil.rmtree(run)  # its checkpoints
    steps = [{"epoch": line["epoch"], "step": line["step"], "peak_mb": line["peak_memory_mb"],
              "rss_mb": line["rss_mb"]} for line in lines if line.get("event") == "train"]
    return steps, round(seconds, 1)


def epoch_peaks(steps: list[dict]) -> dict[str, float]:
    """The highest high-water mark each epoch's steps logged."""
    return {f"epoch{epoch}_peak_mb": max(s["peak_mb"] for s in steps if s["epoch"] == epoch)
            for epoch in sorted({s["epoch"] for s in steps})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default="9d9f878", help="the checkout the arms and the timing run")
    parser.add_argument("--after-commit", default="38f6667", help="the checkout the after runs run")
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--after", nargs="*", default=list(AFTER), choices=list(AFTER))
    parser.add_argument("--timing-rounds", type=int, default=2, help="rounds of A with the caches on and off")
    json_option(parser, STEM)
    args = parser.parse_args()
    info = describe()
    print(headline(info), flush=True)
    name, train_rows, eval_rows = SCORER
    out: dict = {
        "what": f"configs/{name}.yaml, bf16, train.speedups auto, its training rows, the first {eval_rows} rows of "
                f"its held-out file, {EPOCHS} epochs, train.logging_steps 1, on commit {args.commit} (the heaviest "
                "batch at the second update); each arm one setting changed; per step: metrics.jsonl's "
                "peak_memory_mb (high-water mark) and rss_mb (after the step)",
        "machine": info, "commit": args.commit, "after_commit": args.after_commit}
    path = args.json or results_path(STEM)
    with tempfile.TemporaryDirectory(prefix="qatune-kernel-caches-runs-") as folder:
        work = Path(folder)
        if args.arms or args.timing_rounds:
            with checkout(args.commit) as tree:
                base = settings(tree, name, train_rows, eval_rows, work)
                arms: dict[str, dict] = {}
                for label in args.arms:
                    arm = ARMS[label]
                    sets = with_setting(base, arm["set"]) if "set" in arm else base
                    steps, took = train(tree, name, sets, arm.get("env", {}), work / "run")
                    described = {**({"set": arm["set"]} if "set" in arm else {}),
                                 **({"env": " ".join(f"{k}={v}" for k, v in arm["env"].items())} if "env" in arm
                                    else {})}
                    arms[label] = {**described, **epoch_peaks(steps), "steps": steps}
                    print(f"{label} {described or 'as shipped'}: {epoch_peaks(steps)}  {took} s", flush=True)
                if args.timing_rounds:
                    seconds: dict[str, list[float]] = {"caches on": [], "caches off": []}
                    for _, caches in alternating(args.timing_rounds, list(seconds)):
                        env = CACHES_OFF if caches == "caches off" else {}
                        seconds[caches].append(train(tree, name, base, env, work / "run")[1])
                        print(f"timing, {caches}: {seconds[caches][-1]} s", flush=True)
                    out["timing"] = {"what": "the same run (A's settings) timed as a whole process, alternating, "
                                             "without and with both caches off ("
                                             + " ".join(f"{k}={v}" for k, v in CACHES_OFF.items()) + ")",
                                     "seconds": seconds}
        if args.after:
            runs: dict[str, list[dict]] = {}
            with checkout(args.after_commit) as tree:
                for label in args.after:
                    config, rows, held_out = AFTER[label]
                    steps, took = train(tree, config, settings(tree, config, rows, held_out, work), {},
                                        work / "run")
                    runs[label] = steps
                    print(f"{label} {config} {rows} rows, {held_out or 'no'} held-out: {epoch_peaks(steps)}  "
                          f"{took} s", flush=True)
            out["after"] = {"what": f"on commit {args.after_commit} (the heaviest batch last, the heap trimmed "
                                    f"before it), {EPOCHS} epochs, bf16, auto: "
                                    + "; ".join(f"{label}: configs/{AFTER[label][0]}.yaml on its first "
                                                f"{AFTER[label][1]} training rows, "
                                                + (f"its first {AFTER[label][2]} held-out rows" if AFTER[label][2]
                                                   else "no validation") for label in args.after),
                            "runs": runs}
    if args.arms:
        out["arms"] = arms
    write_json(path, out)


if __name__ == "__main__":
    main()
