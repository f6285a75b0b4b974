"""`make demo` and `make demo-tiny` as a user runs them on their first day, timed: their wall time, and the
before/after scores and the table `make demo` prints.

Runs `make demo` in the repository (the virtualenv already installed, so installation is not timed) with an empty
GGUF conversion cache (QATUNE_CACHE_DIR: a new folder, so the first command converts the packaged file as it does
for a new user), then reads the two evaluations it wrote (the untouched model, the fine-tuned one), the table it
printed and the answer it generated; then `make demo-tiny`. Writes bench/results/<this machine>/make_demo.json;
README quotes it.

    python bench/probes/make_demo.py          # about 6 minutes on 2 cores with native bf16

With --model NAME, the same four steps as `make demo` (the untouched model, training, the fine-tuned model, the
answer) with `model.name_or_path` set to NAME and the run in runs/NAME-demo, writing make_demo_NAME.json: whether
another packaged model gives a clearly better before/after within the same few minutes.

    python bench/probes/make_demo.py --model gemma3-270m
    python bench/probes/make_demo.py --model gemma3-270m --set train.learning_rate=5e-5 --json .../FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_machine import describe, headline, results_path, write_json

ROOT = Path(__file__).resolve().parents[2]
EVALS = {"base": ROOT / "runs" / "smollm2-demo-base" / "eval-xquad_demo.json",
         "fine_tuned": ROOT / "runs" / "smollm2-demo" / "eval-xquad_demo.json"}
CONFIG = "configs/smollm2-demo.yaml"
HELD_OUT = "examples/data/xquad_demo.csv"


def make_variable(name: str) -> str:
    """A variable of the Makefile, as make expands it."""
    done = subprocess.run(["make", "-s", "--eval", f"print-var:; @echo $({name})", "print-var"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    return done.stdout.strip()


def demo_with(model: str, env: dict, overrides: list[str]) -> tuple[subprocess.CompletedProcess, dict]:
    """`make demo`'s four steps with another model (and the config's ``overrides``, KEY=VALUE): its output and the
    two evaluations' paths."""
    qatune = str(ROOT / ".venv" / "bin" / "qatune")
    run = ROOT / "runs" / f"{model}-demo"
    sets = [arg for pair in [f"model.name_or_path={model}", f"output_dir={run}", *overrides] for arg in ("--set", pair)]
    evals = {"base": run.with_name(run.name + "-base") / "eval-xquad_demo.json",
             "fine_tuned": run / "eval-xquad_demo.json"}
    for path in evals.values():
        path.unlink(missing_ok=True)
    steps = [[qatune, "eval", "--base", "--config", CONFIG, "--data", HELD_OUT, *sets],
             [qatune, "train", "--config", CONFIG, "--overwrite", *sets],
             [qatune, "eval", str(run), "--data", HELD_OUT],
             [str(ROOT / ".venv" / "bin" / "python"), "examples/compare_evals.py", *map(str, evals.values())],
             [qatune, "generate", str(run), "Which river flows through Warsaw?", "--context", make_variable("WARSAW")]]
    stdout = []
    for step in steps:
        done = subprocess.run(step, cwd=ROOT, capture_output=True, text=True, check=False, env=env)
        stdout.append(done.stdout)
        if done.returncode != 0:
            return subprocess.CompletedProcess(step, done.returncode, "".join(stdout), done.stderr), evals
    return subprocess.CompletedProcess(steps, 0, "".join(stdout), ""), evals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="another packaged model for make demo's four steps")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="with --model: a config key for the untouched model and the training")
    parser.add_argument("--json", type=Path, default=None, help="default: bench/results/<machine>/make_demo*.json")
    args = parser.parse_args()
    info = describe()
    print(headline(info), flush=True)
    if not (ROOT / ".venv" / ".installed").is_file():
        raise SystemExit("install first (make install): the demo's own time is measured, not the installation's")
    evals = EVALS
    for path in evals.values():
        path.unlink(missing_ok=True)
    tiny_seconds = None
    with tempfile.TemporaryDirectory(prefix="qatune-demo-cache-") as cache:
        env = {**os.environ, "QATUNE_CACHE_DIR": cache}
        start = time.perf_counter()
        if args.model:
            done, evals = demo_with(args.model, env, args.set)
        else:
            done = subprocess.run(["make", "demo"], cwd=ROOT, capture_output=True, text=True, check=False, env=env)
        seconds = time.perf_counter() - start
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise SystemExit(f"make demo failed:\n{(done.stdout + done.stderr)[-3000:]}")
        if not args.model:
            start = time.perf_counter()
            tiny = subprocess.run(["make", "demo-tiny"], cwd=ROOT, capture_output=True, text=True, check=False,
                                  env=env)
            tiny_seconds = time.perf_counter() - start
            if tiny.returncode != 0:
                raise SystemExit(f"make demo-tiny failed:\n{(tiny.stdout + tiny.stderr)[-3000:]}")
        converted = {folder.name: round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6, 1)
                     for folder in (Path(cache) / "gguf").glob("*") if folder.is_dir()}  # none: read directly
    lines = done.stdout.strip().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("model "))
    table = lines[first:first + 1 + len(evals)]  # the header, the untouched model, the fine-tuned one
    scores = {}
    for arm, path in evals.items():
        metrics = json.loads(path.read_text(encoding="utf-8"))
        scores[arm] = {key: metrics[key] for key in ("exact_match", "f1", "loss", "num_examples")}
    answer = lines[-1]
    print(f"make demo{' with ' + args.model if args.model else ''}: {seconds / 60:.1f} min wall "
          f"({usage.ru_utime + usage.ru_stime:.0f} CPU seconds); "
          f"EM {scores['base']['exact_match']:.1f} -> {scores['fine_tuned']['exact_match']:.1f}, "
          f"F1 {scores['base']['f1']:.1f} -> {scores['fine_tuned']['f1']:.1f}; answer: {answer}"
          + (f"; make demo-tiny: {tiny_seconds:.0f} s" if tiny_seconds is not None else ""), flush=True)
    print("\n".join(table))
    result = {"benchmark": "make demo, then make demo-tiny (an empty GGUF conversion cache)", "machine": info,
              "wall_seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime, "scores": scores,
              "printed": table, "answer": answer, "demo_tiny_wall_seconds": tiny_seconds, "gguf_cache_mb": converted}
    if args.model:
        result |= {"benchmark": f"make demo's four steps with model.name_or_path={args.model} (an empty cache)",
                   "model": args.model, "sets": args.set}
        del result["demo_tiny_wall_seconds"]
    write_json(args.json or results_path(f"make_demo_{args.model}" if args.model else "make_demo"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
