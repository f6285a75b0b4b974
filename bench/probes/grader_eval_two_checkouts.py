"""A generative grader's `qatune eval` from two checkouts side by side: did a change to how a grader's answers are
written make its evaluation faster or lighter, and did it change what it answers?

Runs `qatune eval RUN --data SHEET --json` with another checkout's ``src/`` ("before", e.g. a `git worktree add
/tmp/before COMMIT`) and with this one ("after"), alternating round by round in fresh processes. Prints each run's
wall time and peak RSS, the before/after time ratio (above 1: this checkout is faster) and the metrics of each arm;
the verdicts and marks of the two arms should agree. SHEET: the first --rows rows of grading_data.py's unseen
answers, unless --data names a sheet. RUN: a trained grader (grading.py --keep DIR keeps its runs).

    git worktree add /tmp/before COMMIT
    python bench/probes/grader_eval_two_checkouts.py --before /tmp/before/src --run /tmp/grading-runs/smollm2-grading-42
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quality"))  # bench/quality/, for grading_data

from bench_machine import CHILD_ENV, ROOT, alternating, describe, headline, json_option, results_path, write_json
from grading import summary

STEM = "grader_eval_two_checkouts"


def evaluated(command: list[str], env: dict[str, str]) -> dict:
    """Wall time, peak RSS and metrics of one `qatune eval --json` process."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **CHILD_ENV, **env}, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{stderr[-3000:]}")
    metrics = json.loads(stdout)
    return {"seconds": seconds, "peak_rss_mb": usage.ru_maxrss / 1024,
            "metrics": {**summary(metrics), "loss": metrics.get("loss")}}


def sheet(rows: int, path: Path) -> Path:
    from grading_data import saf_split, write_csv

    write_csv(saf_split()["unseen_answers"].head(rows), path)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other checkout's src/ folder")
    parser.add_argument("--run", type=Path, required=True, help="a trained generative grader's run folder")
    parser.add_argument("--data", type=Path, help="the sheet to evaluate on (default: unseen answers' first --rows)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    json_option(parser, STEM)
    args = parser.parse_args()
    if not (args.before / "qatune" / "__init__.py").is_file():
        raise SystemExit(f"{args.before} holds no qatune package; pass a checkout's src/ folder")
    info = describe()
    print(headline(info), flush=True)
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or sheet(args.rows, Path(tmp) / "unseen_answers.csv")
        command = [sys.executable, "-m", "qatune", "eval", str(args.run), "--data", str(data), "--json"]
        paths = {"before": str(args.before.resolve()), "after": str(ROOT / "src")}
        print(f"{args.run} on {data}; before: {args.before}", flush=True)
        for round_, arm in alternating(args.rounds, list(runs)):
            result = evaluated(command, {"PYTHONPATH": paths[arm]})
            runs[arm].append(result)
            print(f"round {round_ + 1} {arm:6} {result['seconds']:6.1f} s  peak RSS {result['peak_rss_mb']:6.0f} MB  "
                  f"{result['metrics']}", flush=True)
    before_over_after = [b["seconds"] / a["seconds"] for b, a in zip(runs["before"], runs["after"])]
    print(f"\nbefore / after, wall time: {', '.join(f'x{r:.3f}' for r in before_over_after)} per round, median "
          f"x{statistics.median(before_over_after):.3f}")
    write_json(args.json or results_path(STEM), {
        "benchmark": "a generative grader's qatune eval, two checkouts", "machine": info, "run": str(args.run),
        "data": str(args.data) if args.data else f"grading_data.py's unseen answers, first {args.rows} rows",
        "before": str(args.before), "runs": runs, "before_over_after": before_over_after,
        "median_before_over_after": statistics.median(before_over_after)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
