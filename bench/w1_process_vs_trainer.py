"""W1 as whole processes: `qatune train` against a Trainer-best script doing the same work, wall time and peak
memory of everything (imports, tokenizer training, model building, encoding, the loop, saving).

The Trainer arm is bench/w1_trainer_best.py (read it: the same rows, tokenizer, model, batch size, learning
rate, clipping, length grouping and precision; bench/workloads.py defines W1). qatune runs its own defaults on
top: the batch validator, run.json, metrics.jsonl, a resumable checkpoint at the end of the epoch, final/ with
its manifest, report.md and loss.png. Each arm runs in a fresh process, the arms alternating round by round.
Prints per-round ratios (the Trainer script's wall time over qatune's) and their median, and the CPU.

    python bench/w1_process_vs_trainer.py                # 3 rounds, ~3 minutes on 2 cores with native bf16
    python bench/w1_process_vs_trainer.py --rounds 5
    python bench/w1_process_vs_trainer.py --precision fp32   # both arms in fp32: w1_process_vs_trainer_fp32.json
    python bench/w1_process_vs_trainer.py --avx2-only    # torch held to AVX2 (a CPU without native bf16):
                                                         # w1_process_vs_trainer_avx2_only.json
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

from bench_machine import (
    AVX2_ONLY,
    CHILD_ENV,
    ROOT,
    alternating,
    describe,
    headline,
    json_option,
    results_path,
    write_json,
)
from workloads import W1, need_shared_data, precision, qatune_arm, speedups_setting, w1_overrides, write_nq_rows

STEM = "w1_process_vs_trainer"


def timed(command: list[str]) -> dict:
    """Wall time and peak RSS of one child process, and the log line that says which speed paths it had on."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **CHILD_ENV}, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    stderr = proc.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{stderr[-3000:]}")
    line = next((x for x in stderr.splitlines() if "speedups (" in x), None)
    return {"seconds": seconds, "peak_rss_mb": usage.ru_maxrss / 1024,
            **({"speedups": line[line.index("speedups ("):]} if line else {})}


def write_config(overrides: list[str], path: Path) -> Path:
    """``key=value`` overrides as the YAML config file a user would write."""
    import yaml

    config: dict = {}
    for override in overrides:
        key, value = override.split("=", 1)
        *sections, name = key.split(".")
        node = config
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=W1.rows)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (every arm once per round)")
    parser.add_argument("--precision", choices=["auto", "fp32"], default="auto",
                        help="auto: each arm picks bf16 where native, else fp32; fp32: both arms in fp32")
    parser.add_argument("--avx2-only", action="store_true", help="torch's kernels kept to AVX2 in every arm (this "
                        "CPU as one without native bf16; both arms choose their precision as they would there)")
    parser.add_argument("--speedups", nargs="+", default=["auto"], metavar="SETTING",
                        help="train.speedups of each qatune arm: auto, off, all or a comma-separated list of paths")
    json_option(parser, STEM)
    args = parser.parse_args()
    suffix = "_fp32" if args.precision == "fp32" and precision("auto") != "fp32" else ""
    if args.avx2_only:
        os.environ.update(AVX2_ONLY)  # read by torch in each child process (and recorded by describe())
        suffix += "_avx2_only"
    need_shared_data()
    info = describe()
    print(headline(info), flush=True)
    qatune_arms = {qatune_arm(text): speedups_setting(text) for text in args.speedups}
    arms = [*qatune_arms, "trainer"]
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_nq_rows(args.rows, Path(tmp) / "nq.csv")
        commands = {arm: [sys.executable, "-m", "qatune", "train", "--config",
                          str(write_config(w1_overrides(data, args.precision, 42, setting), Path(tmp) / f"{i}.yaml")),
                          "--output-dir", str(Path(tmp) / f"qatune-{i}"), "--overwrite", "--quiet"]
                    for i, (arm, setting) in enumerate(qatune_arms.items())}
        commands["trainer"] = [sys.executable, str(ROOT / "bench" / "w1_trainer_best.py"), str(data),
                               str(Path(tmp) / "trainer-run"), *(["--fp32"] if args.precision == "fp32" else [])]
        print(f"{W1.describe(args.rows)}; whole processes", flush=True)
        for round_, arm in alternating(args.rounds, arms):
            result = timed(commands[arm])
            runs[arm].append(result)
            print(f"round {round_ + 1} {arm:24} {result['seconds']:6.1f} s  peak RSS {result['peak_rss_mb']:6.0f} MB",
                  flush=True)
        chosen = {arm: json.loads((Path(tmp) / f"qatune-{i}" / "run.json").read_text()).get("precision")
                  for i, arm in enumerate(qatune_arms)}
        chosen["trainer"] = (Path(tmp) / "trainer-run" / "precision.txt").read_text(encoding="utf-8")
    ratios = {arm: [t["seconds"] / q["seconds"] for q, t in zip(runs[arm], runs["trainer"])] for arm in qatune_arms}
    medians = {arm: statistics.median(values) for arm, values in ratios.items()}
    summary = {arm: {"median_seconds": statistics.median(r["seconds"] for r in results),
                     "peak_rss_mb": max(r["peak_rss_mb"] for r in results), "precision": chosen[arm]}
               for arm, results in runs.items()}
    print()
    for arm, values in ratios.items():
        print(f"{arm} / Trainer script, wall time: {', '.join(f'x{r:.2f}' for r in values)} per round, median "
              f"x{medians[arm]:.2f}; precision {chosen[arm]} / {chosen['trainer']}; peak RSS "
              f"{summary[arm]['peak_rss_mb']:.0f} / {summary['trainer']['peak_rss_mb']:.0f} MB")
    write_json(args.json or results_path(STEM, suffix), {
        "benchmark": "w1-process", "workload": W1.describe(args.rows), "machine": info, "rows": args.rows,
        "precision": chosen[next(iter(qatune_arms))], "trainer_precision": chosen["trainer"], "reference": "trainer",
        "speedups": qatune_arms, "runs": runs, "summary": summary, "ratios": ratios, "median_ratio": medians})
    return 0


if __name__ == "__main__":
    sys.exit(main())
