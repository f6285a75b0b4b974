"""Rounding batch widths up on CPU: fewer matrix shapes against more padded tokens, W1's loop.

oneDNN (torch's bf16 matrix products on CPU) builds a kernel for each new shape it meets, ~3 ms for one
of W1's products against ~0.4 ms to run it; every new batch width brings a dozen new shapes. Rounding
widths up to a multiple P makes fewer widths and more padding. Each arm is qatune's own loop (`fit`) on
W1 with widths rounded to P, one epoch, in a fresh process (oneDNN's kernel cache lives in the process);
arms alternate within each round. Prints seconds per arm, distinct widths, the padding share and the
ratio to P=1 per round and its median; writes bench/cpu_pad_multiple.json (or _fp32 with --precision fp32).

    python bench/cpu_pad_multiple.py                  # P = 1, 2, 4, 8; 3 rounds; ~3 minutes on 2 cores
    python bench/cpu_pad_multiple.py --precision fp32 --multiples 1 2
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

from bench_machine import W1_CONFIG, describe_torch, headline, native_bf16, write_json, write_nq_rows

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("QATUNE_SHARED_DATA", ROOT.parent / "shared" / "data"))


def arm(config: Path, multiple: int) -> dict:
    """One epoch of qatune's loop with batch widths rounded up to ``multiple`` (in this process)."""
    from qatune.config import load_config
    from qatune.train import loop
    from qatune.train.run import prepare_checked

    prepared = prepare_checked(load_config(config))
    collate, seen = prepared.collator, {"widths": set(), "computed": 0, "real": 0}
    collate.pad_to_multiple_of = multiple

    def counting(items):
        batch = collate(items)
        seen["widths"].add(batch["input_ids"].shape[1])
        seen["computed"] += batch["input_ids"].numel()
        seen["real"] += int(batch["attention_mask"].sum())
        return batch

    prepared.collator = counting  # a plain function: Loop.setup finds no pad_to_multiple_of to set on it
    start = time.perf_counter()
    result = loop.fit(prepared, None, progress=False)
    return {"seconds": time.perf_counter() - start, "widths": len(seen["widths"]),
            "padding_share": 1 - seen["real"] / seen["computed"], "final_loss": result.get("final_train_loss")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16" if native_bf16() else "fp32")
    parser.add_argument("--json", type=Path, default=None, help="default: bench/cpu_pad_multiple[_fp32].json")
    parser.add_argument("--arm", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm is not None:
        print("RESULT " + json.dumps(arm(args.config, args.arm)), flush=True)
        return 0
    out = args.json or Path(__file__).with_name("cpu_pad_multiple" + ("_fp32" if args.precision == "fp32" else "")
                                                + ".json")
    info = describe_torch()
    print(f"{headline(info)}; W1 loop, {args.rows} rows, {args.precision}", flush=True)
    runs: dict[int, list[dict]] = {p: [] for p in args.multiples}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_nq_rows(SHARED, args.rows, Path(tmp) / "nq.csv")
        config = Path(tmp) / "w1.yaml"
        config.write_text(W1_CONFIG.format(seed=42, data=data, precision=args.precision), encoding="utf-8")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        for round_ in range(args.rounds):
            order = args.multiples if round_ % 2 == 0 else list(reversed(args.multiples))
            for multiple in order:
                proc = subprocess.run([sys.executable, __file__, "--arm", str(multiple), "--config", str(config)],
                                      capture_output=True, text=True, env=env, cwd=ROOT, check=False)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if proc.returncode != 0 or line is None:
                    raise SystemExit(f"arm P={multiple} failed:\n{proc.stderr[-3000:]}")
                result = json.loads(line[len("RESULT "):])
                runs[multiple].append(result)
                print(f"round {round_ + 1} P={multiple}: {result['seconds']:5.2f} s, {result['widths']:2d} widths, "
                      f"padding {100 * result['padding_share']:4.1f}%", flush=True)
    base = args.multiples[0]
    ratios = {p: [b["seconds"] / r["seconds"] for b, r in zip(runs[base], runs[p])] for p in args.multiples}
    print(f"\nspeed against P={base} (median of rounds):")
    for p in args.multiples:
        print(f"  P={p}: x{statistics.median(ratios[p]):.3f} ({', '.join(f'x{r:.3f}' for r in ratios[p])}), "
              f"{runs[p][0]['widths']} widths, padding {100 * runs[p][0]['padding_share']:.1f}%")
    write_json(out, {"machine": info, "precision": args.precision, "rows": args.rows, "runs": runs,
                     "ratios_to_first": ratios, "median_ratio": {p: statistics.median(r) for p, r in ratios.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
