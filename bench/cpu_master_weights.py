"""bf16 training on CPU: autocast over fp32 weights, or bf16 weights with fp32 masters (what qatune does);
and the LM head over the supervised rows padded to a multiple of 64 rows, or not.

What src/qatune/train/master.py and objectives.HEAD_ROWS_MULTIPLE rest on. qatune's own W1 loop (1,000
NQ-open rows, GPT-2 6x512x8 from config, batch 16, one epoch under bf16) runs in a fresh process per arm,
the arms alternating within each round: "autocast" holds fp32 weights under bf16 autocast (qatune before
the change; what Trainer does), "masters" holds bf16 weights and lets the optimizer update fp32 copies
(both with the padded head), "unpadded" is "masters" with the head run on exactly the supervised rows.
Prints milliseconds per optimizer step over the whole epoch, peak RSS and the mean loss of the last 10
steps per arm, and the ratios per round.

    python bench/cpu_master_weights.py              # 3 rounds, ~5 minutes on 2 cores with native bf16
    python bench/cpu_master_weights.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_machine import W1_CONFIG, describe, headline, native_bf16, write_nq_rows  # bench/ is on sys.path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("QATUNE_SHARED_DATA", ROOT.parent / "shared" / "data"))
OUT = Path(__file__).with_suffix(".json")
ARMS = ["autocast", "masters", "unpadded"]


def arm(name: str, config_path: str) -> dict:
    """One epoch of qatune's loop (no run directory) in this process."""
    import qatune.train.loop as loop_module
    from qatune.config import load_config
    from qatune.train.run import prepare_checked

    if name == "autocast":
        loop_module.master_weights_wanted = lambda *_: False
    if name == "unpadded":
        import qatune.model.objectives

        qatune.model.objectives.HEAD_ROWS_MULTIPLE = 1
    prepared = prepare_checked(load_config(config_path))
    loop = loop_module.Loop.setup(prepared, None, None)
    loop.start_epoch(0)
    windows = list(loop_module.windows(loop.loader, 1))
    start = time.perf_counter()
    losses = [done["loss"] for done in (loop_module.train_step(loop, w) for w in windows) if done]
    seconds = time.perf_counter() - start
    return {"ms_per_step": 1000 * seconds / len(windows), "steps": len(windows), "masters": loop.masters is not None,
            "last_10_loss": statistics.mean(losses[-10:]),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print("RESULT " + json.dumps(arm(args.arm, args.config)), flush=True)
        return 0
    info = describe()
    print(headline(info), flush=True)
    if not native_bf16():
        print("note: this CPU emulates bf16; qatune trains in fp32 here unless told otherwise", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_nq_rows(SHARED, 1000, Path(tmp) / "nq.csv")
        config = Path(tmp) / "w1.yaml"
        config.write_text(W1_CONFIG.format(seed=42, data=data, precision="bf16"), encoding="utf-8")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        for round_ in range(args.rounds):
            for name in (ARMS if round_ % 2 == 0 else ARMS[::-1]):
                done = subprocess.run([sys.executable, __file__, "--arm", name, "--config", str(config)], check=False,
                                      capture_output=True, text=True, env=env, cwd=ROOT)
                line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return 1
                result = json.loads(line[len("RESULT "):])
                runs[name].append(result)
                print(f"round {round_ + 1} {name:8} {result['ms_per_step']:6.1f} ms/step  peak RSS "
                      f"{result['peak_rss_mb']:5.0f} MB  loss (last 10 steps) {result['last_10_loss']:.3f}", flush=True)
            masters = runs["masters"][-1]["ms_per_step"]
            print(f"round {round_ + 1} autocast / masters: x{runs['autocast'][-1]['ms_per_step'] / masters:.2f}; "
                  f"unpadded / padded head: x{runs['unpadded'][-1]['ms_per_step'] / masters:.2f}", flush=True)
    ratios = {f"{other}/masters": [o["ms_per_step"] / m["ms_per_step"] for o, m in zip(runs[other], runs["masters"])]
              for other in ("autocast", "unpadded")}
    rss = {name: max(r["peak_rss_mb"] for r in results) for name, results in runs.items()}
    for key, values in ratios.items():
        print(f"\n{key} milliseconds per step: median x{statistics.median(values):.2f} "
              f"({', '.join(f'x{r:.2f}' for r in values)})")
    print(f"peak RSS: {', '.join(f'{name} {mb:.0f} MB' for name, mb in rss.items())}")
    OUT.write_text(json.dumps({"machine": info, "runs": runs, "ratios": ratios,
                               "median_ratios": {k: statistics.median(v) for k, v in ratios.items()},
                               "peak_rss_mb": rss, "measured": time.strftime("%Y-%m-%d %H:%M")}, indent=2) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
