"""W1 as whole processes with two checkouts of qatune side by side: did a change make `qatune train` slower?

Runs `qatune train` on W1 from this checkout ("after") and from another one's ``src/`` ("before", e.g. a
`git worktree add /tmp/before COMMIT`), and the Trainer-best script, alternating round by round in fresh
processes. Prints each arm's ratio to the Trainer script per round and the median, and the before/after time
ratio (above 1: this checkout is faster). The "before" config carries no train.speedups key (a checkout older
than the key would refuse it); both arms run their defaults.

    git worktree add /tmp/before 891f31b
    python bench/probes/w1_process_two_checkouts.py --before /tmp/before/src --rounds 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_machine import alternating, describe, headline, json_option, results_path, write_json
from w1_process_vs_trainer import timed, write_config
from workloads import W1, need_shared_data, w1_overrides, write_nq_rows

ROOT = Path(__file__).resolve().parents[2]
STEM = "w1_process_two_checkouts"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other checkout's src/ folder")
    parser.add_argument("--rows", type=int, default=W1.rows)
    parser.add_argument("--rounds", type=int, default=5)
    json_option(parser, STEM)
    args = parser.parse_args()
    if not (args.before / "qatune" / "__init__.py").is_file():
        raise SystemExit(f"{args.before} holds no qatune package; pass a checkout's src/ folder")
    need_shared_data()
    info = describe()
    print(headline(info), flush=True)
    runs: dict[str, list[dict]] = {"before": [], "after": [], "trainer": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = write_nq_rows(args.rows, work / "nq.csv")
        overrides = [o for o in w1_overrides(data, "auto") if not o.startswith("train.speedups")]
        config = str(write_config(overrides, work / "w1.yaml"))
        train = [sys.executable, "-m", "qatune", "train", "--config", config, "--overwrite", "--quiet"]
        commands = {"before": ["env", f"PYTHONPATH={args.before.resolve()}", *train, "--output-dir",
                               str(work / "before")],
                    "after": [*train, "--output-dir", str(work / "after")],
                    "trainer": [sys.executable, str(ROOT / "bench" / "w1_trainer_best.py"), str(data),
                                str(work / "trainer-run")]}
        print(f"{W1.describe(args.rows)}; whole processes; before: {args.before}", flush=True)
        for round_, arm in alternating(args.rounds, list(runs)):
            result = timed(commands[arm])
            runs[arm].append(result)
            print(f"round {round_ + 1} {arm:8} {result['seconds']:6.1f} s  peak RSS {result['peak_rss_mb']:6.0f} MB",
                  flush=True)
        precision = {arm: json.loads((work / arm / "run.json").read_text()).get("precision")
                     for arm in ("before", "after")}
    ratios = {arm: [t["seconds"] / q["seconds"] for q, t in zip(runs[arm], runs["trainer"])]
              for arm in ("before", "after")}
    before_over_after = [b["seconds"] / a["seconds"] for b, a in zip(runs["before"], runs["after"])]
    print()
    for arm, values in ratios.items():
        print(f"{arm} / Trainer script: {', '.join(f'x{r:.2f}' for r in values)} per round, median "
              f"x{statistics.median(values):.2f} ({precision[arm]})")
    print(f"before / after, wall time: {', '.join(f'x{r:.3f}' for r in before_over_after)} per round, median "
          f"x{statistics.median(before_over_after):.3f}")
    write_json(args.json or results_path(STEM), {
        "benchmark": "w1-process, two checkouts", "workload": W1.describe(args.rows), "machine": info,
        "before": str(args.before), "precision": precision, "runs": runs, "ratios": ratios,
        "median_ratio": {arm: statistics.median(values) for arm, values in ratios.items()},
        "before_over_after": before_over_after, "median_before_over_after": statistics.median(before_over_after)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
