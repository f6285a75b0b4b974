"""The headline benchmarks on this machine, one after another, then the table of docs/performance.md refreshed.

    w1-loop      W1's training loop: qatune's fit vs transformers.Trainer        bench/w1_loop_vs_trainer.py
    w1-process   W1 as whole processes: `qatune train` vs w1_trainer_best.py     bench/w1_process_vs_trainer.py
    w2           SmolLM2-135M LoRA: qatune vs TRL's SFTTrainer                   bench/w2_lora_vs_trl.py
    extractive   MiniLM extractive QA: qatune vs Trainer + run_qa.py             bench/extractive_vs_trainer.py
    serve        `qatune serve` under load: batching on vs off                   bench/serve_load.py
    smollm2-qa   SmolLM2 with the shipped configs: fine-tuned vs base, F1/EM     bench/quality/smollm2_qa.py

Each script compares two (or more) arms side by side, alternating them round by round, prints the CPU it runs
on and writes its JSON to bench/results/<this machine>/ (``--out`` elsewhere). On 2 CPU cores the whole set
takes about 1.5 hours with native bf16 (W2 and smollm2-qa are most of it), over 2.5 hours without.

    python bench/headline.py                          # everything (make bench)
    python bench/headline.py --only w1-process        # one or more of the names above
    python bench/headline.py --only w1-loop w2 --rounds 2 --w2-rows 200
    python bench/headline.py --quick --out /tmp/bench # every script end to end at the smallest sizes
    python bench/headline.py --table-only             # the docs table from the committed results
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import table
from bench_machine import RESULTS, ROOT, machine_name

SCRIPTS = {
    "w1-loop": "w1_loop_vs_trainer.py",
    "w1-process": "w1_process_vs_trainer.py",
    "w2": "w2_lora_vs_trl.py",
    "extractive": "extractive_vs_trainer.py",
    "serve": "serve_load.py",
    "smollm2-qa": "quality/smollm2_qa.py",
}
TRAINING = ("w1-loop", "w1-process", "w2", "extractive")
"""The headlines that train qatune against an anchor (they take --speedups and --precision)."""
QUICK = {
    "w1-loop": ["--rows", "96", "--rounds", "1"],
    "w1-process": ["--rows", "96", "--rounds", "1"],
    "w2": ["--rows", "16", "--rounds", "1"],
    "extractive": ["--train-rows", "40", "--eval-rows", "20", "--epochs", "1", "--rounds", "1"],
    "serve": ["--rounds", "1", "--duration", "2", "--clients", "1,4", "--memory-seconds", "4"],
    "smollm2-qa": ["--train-rows", "16", "--eval-rows", "8", "--faq-rows", "8"],
}
"""The smallest sizes that run each script end to end (a smoke test; the figures mean nothing)."""


def arguments(name: str, args: argparse.Namespace) -> list[str]:
    """The command-line options ``name``'s script gets from ours."""
    extra = list(QUICK[name]) if args.quick else []
    if args.rounds is not None and name != "smollm2-qa":
        extra += ["--rounds", str(args.rounds)]
    if args.w1_rows is not None and name in ("w1-loop", "w1-process"):
        extra += ["--rows", str(args.w1_rows)]
    if args.w2_rows is not None and name == "w2":
        extra += ["--rows", str(args.w2_rows)]
    if name in TRAINING:
        settings = args.speedups[:1] if name == "extractive" else args.speedups
        extra += ["--speedups", *settings]
        if args.precision == "fp32" or (args.precision == "bf16" and name != "w1-process"):
            extra += ["--precision", args.precision]
    return extra


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=list(SCRIPTS), metavar="NAME",
                        help="the headlines to run: " + ", ".join(SCRIPTS))
    parser.add_argument("--rounds", type=int, help="alternating rounds of each comparison (default: each script's)")
    parser.add_argument("--w1-rows", type=int, help="W1's rows (default 1,000)")
    parser.add_argument("--w2-rows", type=int, help="W2's rows (default 500)")
    parser.add_argument("--speedups", nargs="+", default=["auto"], metavar="SETTING",
                        help="train.speedups of the qatune arms, one arm per setting: auto, off, all or a "
                             "comma-separated list of paths (extractive takes the first)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="both arms' precision in the training comparisons (w1-process: auto or fp32)")
    parser.add_argument("--quick", action="store_true", help="the smallest sizes, to see every script run end to "
                        "end; needs --out (its figures are not results)")
    parser.add_argument("--out", type=Path, help="where the JSON files go (default: bench/results/<this machine>/)")
    parser.add_argument("--table-only", action="store_true", help="only refresh the table in docs/performance.md")
    args = parser.parse_args()
    if args.table_only:
        table.write()
        return 0
    if args.quick and args.out is None:
        parser.error("--quick writes figures that mean nothing: give --out a folder outside bench/results/")
    out = args.out or RESULTS / machine_name()
    env = {**os.environ, "QATUNE_BENCH_RESULTS": str(out.resolve())}
    print(f"headline benchmarks on {machine_name()}; results in {out}", flush=True)
    done, failed = [], []
    for name in args.only or list(SCRIPTS):
        command = [sys.executable, str(ROOT / "bench" / SCRIPTS[name]), *arguments(name, args)]
        print(f"\n=== {name}: {' '.join(command[1:])}", flush=True)
        start = time.perf_counter()
        code = subprocess.run(command, cwd=ROOT, env=env, check=False).returncode
        minutes = (time.perf_counter() - start) / 60
        print(f"=== {name}: {'done' if code == 0 else f'failed (exit {code})'} in {minutes:.1f} min", flush=True)
        (done if code == 0 else failed).append(name)
    if done and args.out is None:
        table.write()
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
