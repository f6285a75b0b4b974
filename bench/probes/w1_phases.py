"""Where a `qatune train` process on W1 spends its time: imports, each set-up step, the loop, the end-of-run
checkpoint, final/, the report and the exit, measured inside the real command.

Each round runs `qatune train` on W1 in a fresh child process whose functions are wrapped with timers (the
child is this script with --child; nothing in qatune is changed). Prints the median of each phase over the
rounds and its share of the whole process; the "exit" phase is the wall time the parent saw after the
child's last mark.

    python bench/probes/w1_phases.py           # 3 rounds, ~3 minutes on 2 cores
    python bench/probes/w1_phases.py --rounds 5 --rows 1000
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_machine import CHILD_ENV, ROOT, describe, headline, json_option, results_path, write_json
from workloads import W1, need_shared_data, w1_overrides, write_nq_rows

STEM = "w1_phases"

TIMED = [
    ("qatune.train.preparation", "quiet_transformers", "import transformers"),
    ("qatune.train.preparation", "seed_everything", "seed the RNGs (imports accelerate)"),
    ("qatune.train.preparation", "_setup_records", "read the training file (imports pandas)"),
    ("qatune.train.preparation", "train_scratch_tokenizer", "train the tokenizer"),
    ("qatune.train.preparation", "build_scratch", "build the model (with its transformers imports)"),
    ("qatune.train.preparation", "_encode_generative", "encode the rows"),
    ("qatune.train.preparation", "validate_first_batches", "batch validator and settings checks"),
    ("qatune.train.outcome", "prepare", "set-up before anything is written (all of the above)"),
    ("qatune.train.loop", "Loop.setup", "loop set-up (accelerator, objective checks, optimizer)"),
    ("qatune.train.loop", "Loop.checkpoint", "the end-of-epoch checkpoint"),
    ("qatune.train.loop", "Loop.finish", "final/ (linked from the checkpoint)"),
    ("qatune.train.outcome", "fit", "fit (the loop, its set-up, checkpoint and final/)"),
    ("qatune.train.outcome", "write_report", "report.md and loss.png"),
]


def child(argv: list[str]) -> int:
    """Run `qatune train argv` with timers around TIMED; print the marks as one JSON line on stderr."""
    start = time.perf_counter()
    marks: dict[str, float] = {}
    import qatune.cli

    import_start = time.perf_counter()
    import qatune.train.run  # torch and what training imports up front

    marks["import torch and qatune.train"] = time.perf_counter() - import_start
    for module_name, attr, label in TIMED:
        owner = importlib.import_module(module_name)
        name = attr
        if "." in attr:
            cls, name = attr.split(".")
            owner = getattr(owner, cls)
        real = getattr(owner, name)

        def timed(*args, _real=real, _label=label, **kwargs):
            begin = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                marks[_label] = marks.get(_label, 0.0) + time.perf_counter() - begin

        setattr(owner, name, timed)

    import atexit

    atexit.register(lambda: print("PHASES " + json.dumps({**marks, "_end": time.perf_counter() - start}),
                                  file=sys.stderr, flush=True))
    sys.argv = ["qatune", *argv]
    return qatune.cli.entry()


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=W1.rows)
    parser.add_argument("--rounds", type=int, default=3)
    json_option(parser, STEM)
    args = parser.parse_args()
    need_shared_data()
    info = describe()
    print(headline(info), flush=True)
    rounds = []
    env = {**os.environ, **CHILD_ENV}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_nq_rows(args.rows, Path(tmp) / "nq.csv")
        config = Path(tmp) / "w1.yaml"
        config.write_text("seed: 42\n", encoding="utf-8")
        overrides = [f"--set={override}" for override in w1_overrides(data, "auto")]
        for round_ in range(args.rounds):
            command = [sys.executable, __file__, "--child", "train", "--config", str(config), *overrides,
                       "--output-dir", str(Path(tmp) / "run"), "--overwrite", "--quiet"]
            begin = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
            wall = time.perf_counter() - begin
            line = next((x for x in done.stderr.splitlines() if x.startswith("PHASES ")), None)
            if done.returncode != 0 or line is None:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            marks = json.loads(line[len("PHASES "):])
            marks["exit (after the last mark)"] = wall - marks.pop("_end")
            marks["whole process"] = wall
            rounds.append(marks)
            print(f"round {round_ + 1}: {wall:.1f} s", flush=True)
        precision = json.loads((Path(tmp) / "run" / "run.json").read_text())["precision"]
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    whole = median["whole process"]
    print(f"\nW1, {args.rows} rows, precision {precision}: median of {args.rounds} rounds")
    for key, seconds in median.items():
        print(f"{seconds:8.2f} s  {100 * seconds / whole:5.1f}%  {key}")
    write_json(args.json or results_path(STEM), {"machine": info, "rows": args.rows, "precision": precision,
                                                 "rounds": rounds, "median_seconds": median})
    return 0


if __name__ == "__main__":
    sys.exit(main())
