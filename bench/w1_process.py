"""W1 as whole processes: `qatune train` against a Trainer-best script doing the same work, wall time and
peak memory (everything: imports, tokenizer training, model building, encoding, the loop, saving).

The Trainer arm is bench/w1_trainer_best.py (read it: the same rows, tokenizer, model, batch size,
learning rate, clipping, length grouping and precision). qatune runs its own defaults on top: the batch
validator, run.json, metrics.jsonl, a resumable checkpoint at the end of the epoch, final/ with its
manifest, report.md and loss.png. Arms alternate, each in a fresh process; each round also runs the two
in the other order. Prints per-round ratios and their median, and which CPU ran them.

    python bench/w1_process.py               # 3 rounds, ~3 minutes on 2 CPU cores with native bf16
    python bench/w1_process.py --rounds 5 --rows 1000
    python bench/w1_process.py --fp32        # both arms in fp32 (as on a CPU without native bf16): w1_process_fp32.json
    python bench/w1_process.py --avx2-only   # torch held to AVX2 (an fp32-only CPU): w1_process_avx2.json
    python bench/w1_process.py --json bench/w1_process_no_bf16_cpu.json   # on a CPU without native bf16
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

from bench_machine import AVX2_ONLY, W1_CONFIG, describe, headline, write_nq_rows  # bench/ is on sys.path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("QATUNE_SHARED_DATA", ROOT.parent / "shared" / "data"))
OUT = Path(__file__).with_suffix(".json")



def timed(command: list[str]) -> dict:
    """Wall time and peak RSS of one child process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    stderr = proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{stderr[-3000:]}")
    return {"seconds": seconds, "peak_rss_mb": usage.ru_maxrss / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fp32", action="store_true", help="both arms in fp32 (precision auto picks it on CPUs "
                        "without native bf16); writes w1_process_fp32.json")
    parser.add_argument("--avx2-only", action="store_true", help="both arms with torch's kernels kept to AVX2 "
                        "(this CPU as one without native bf16; both arms choose their precision as they would "
                        "there); writes w1_process_avx2.json")
    parser.add_argument("--json", type=Path, metavar="PATH", help="where to write the results (default: "
                        "w1_process.json, w1_process_fp32.json with --fp32, w1_process_avx2.json with --avx2-only)")
    args = parser.parse_args()
    out = OUT.with_name(OUT.stem + "_fp32.json") if args.fp32 else OUT
    if args.avx2_only:
        os.environ.update(AVX2_ONLY)  # read by torch in each child process (and recorded by describe())
        out = OUT.with_name(OUT.stem + "_avx2.json")
    out = args.json or out
    info = describe()
    print(headline(info), flush=True)
    runs: dict[str, list[dict]] = {"qatune": [], "trainer": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_nq_rows(SHARED, args.rows, Path(tmp) / "nq.csv")
        config = Path(tmp) / "w1.yaml"
        config.write_text(W1_CONFIG.format(seed=42, data=data, precision="fp32" if args.fp32 else "auto"),
                          encoding="utf-8")
        commands = {
            "qatune": [sys.executable, "-m", "qatune", "train", "--config", str(config), "--output-dir",
                       str(Path(tmp) / "qatune-run"), "--overwrite", "--quiet"],
            "trainer": [sys.executable, str(ROOT / "bench" / "w1_trainer_best.py"), str(data),
                        str(Path(tmp) / "trainer-run"), *(["--fp32"] if args.fp32 else [])],
        }
        for round_ in range(args.rounds):
            order = ("qatune", "trainer") if round_ % 2 == 0 else ("trainer", "qatune")
            for arm in order:
                result = timed(commands[arm])
                runs[arm].append(result)
                print(f"round {round_ + 1} {arm:8} {result['seconds']:6.1f} s  "
                      f"peak RSS {result['peak_rss_mb']:6.0f} MB", flush=True)
            print(f"round {round_ + 1} Trainer / qatune wall time: "
                  f"x{runs['trainer'][-1]['seconds'] / runs['qatune'][-1]['seconds']:.2f}", flush=True)
        status = json.loads((Path(tmp) / "qatune-run" / "run.json").read_text())
        trainer_precision = (Path(tmp) / "trainer-run" / "precision.txt").read_text(encoding="utf-8")
    ratios = [t["seconds"] / q["seconds"] for q, t in zip(runs["qatune"], runs["trainer"])]
    summary = {arm: {"median_seconds": statistics.median(r["seconds"] for r in results),
                     "peak_rss_mb": max(r["peak_rss_mb"] for r in results)} for arm, results in runs.items()}
    print(f"\nqatune is x{statistics.median(ratios):.2f} faster as a whole process (median of "
          f"{', '.join(f'x{r:.2f}' for r in ratios)}); precision qatune {status.get('precision')}, Trainer "
          f"{trainer_precision}; peak RSS qatune "
          f"{summary['qatune']['peak_rss_mb']:.0f} MB, Trainer {summary['trainer']['peak_rss_mb']:.0f} MB")
    out.write_text(json.dumps({"machine": info, "rows": args.rows, "precision": status.get("precision"),
                               "trainer_precision": trainer_precision,
                               "runs": runs, "ratios": ratios, "median_ratio": statistics.median(ratios),
                               "summary": summary, "measured": time.strftime("%Y-%m-%d %H:%M")}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
