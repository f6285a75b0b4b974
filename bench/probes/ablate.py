"""One speed path on and off, switched through ``train.speedups`` alone: how much faster a training step is with it.

The "on" arm trains with ``train.speedups`` listing every path that ``auto`` turns on here (this device and
precision) and NAME; the "off" arm lists the same paths but NAME. Nothing in qatune is patched: each arm is a
fresh process that sets up qatune's own loop from its config, as `qatune train` does, and steps it over the
epoch's batches (``--passes`` times; the first ``--warmup`` batches untimed). A path that cannot apply keeps
itself off and says why (its check, the model, the precision): the script prints what each arm really had on,
and stops when NAME is off in both. The arms alternate round by round; prints each round's ratio (the off
arm's step time over the on arm's: how many times faster the path makes the steps) and their median, page
faults per step and peak RSS, and writes JSON.

Workloads (bench/workloads.py): ``w1`` (GPT-2 from scratch, 1,000 NQ-open rows by default) or ``w2``
(SmolLM2-135M with LoRA, its first 48 rows by default); each path has a default workload where it applies.

    python bench/probes/ablate.py --path lora_one_pass                # W2, 3 rounds, ~5 minutes on 2 cores
    python bench/probes/ablate.py --path width_rounding --precision bf16 --rounds 5
    python bench/probes/ablate.py --path prefix_groups --set train.group_by_prefix=false
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_machine import (
    alternating,
    child_result,
    describe_torch,
    headline,
    print_result,
    results_path,
    write_json,
)
from workloads import (
    W1,
    W2,
    need_shared_data,
    precision,
    training_device,
    w1_overrides,
    w2_build,
    w2_overrides,
    write_nq_rows,
)

W2_PATHS = ("lora_one_pass", "shared_prefix", "prefix_groups", "last_layer_rows", "unpadded_rows",
            "attention_by_width")
"""Paths that apply to W2's SmolLM2 and not to W1's GPT-2 (the others are measured on W1 by default)."""
EXTRA = {"prefix_groups": ["train.group_by_prefix=true"]}
"""Settings both arms need for a path to have something to do (``--set`` overrides them)."""


def arms(name: str, device: str, precision_: str) -> dict[str, list[str]]:
    """train.speedups of each arm: what auto turns on here, with and without ``name``."""
    from qatune.speedups import NAMES, auto_verdict

    on = [path for path in NAMES if path == name or auto_verdict(path, device, precision_) is None]
    return {"on": on, "off": [path for path in on if path != name]}


def child(spec: dict) -> dict:
    """One arm: qatune's loop set up from the config, stepped over the epoch's batches."""
    from qatune.config import load_config
    from qatune.train import Loop, prepare, train_step

    prepared = prepare(load_config(None, spec["overrides"]))
    loop = Loop.setup(prepared, None, None)
    loop.start_epoch(0)
    batches = list(loop.loader)
    untimed = max(spec["warmup"], 1)  # the first step's loss, before any update, is the same in both arms
    first = train_step(loop, [batches[0]])
    for batch in batches[1:untimed]:
        train_step(loop, [batch])
    timed = batches[untimed:] or batches
    before = resource.getrusage(resource.RUSAGE_SELF)
    passes = []
    for _ in range(spec["passes"]):
        start = time.perf_counter()
        for batch in timed:
            train_step(loop, [batch])
        passes.append(time.perf_counter() - start)
    after = resource.getrusage(resource.RUSAGE_SELF)
    steps = len(timed) * spec["passes"]
    loop.speedups.finish()
    return {"seconds": sum(passes), "passes": passes, "steps": steps, "batches": len(batches),
            "first_loss": first["loss"] if first else float("nan"),  # nan: a first batch with no answer tokens
            "faults_per_step": (after.ru_minflt - before.ru_minflt) / steps,
            "peak_rss_mb": after.ru_maxrss / 1024, "speedups": loop.speedups.describe(),
            "on": [name for name, why in loop.speedups.reasons.items() if why is None],
            "why_off": {name: why for name, why in loop.speedups.reasons.items() if why is not None}}


def main() -> int:
    from qatune.speedups import NAMES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", choices=NAMES, help="the speed path to measure")
    parser.add_argument("--workload", choices=["w1", "w2"], help="default: w2 for " + ", ".join(W2_PATHS) + "; "
                        "w1 for the others")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="train.precision of both arms (auto: bf16 where native, else fp32)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (each arm once per round)")
    parser.add_argument("--rows", type=int, help=f"rows of the workload (default: W1 {W1.rows}, W2 48)")
    parser.add_argument("--passes", type=int, default=1, help="timed passes over the epoch's batches per process")
    parser.add_argument("--warmup", type=int, default=1, metavar="BATCHES",
                        help="batches stepped untimed first (at least the first; the rest is timed as a run pays "
                             "it, kernel builds for new batch widths included)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="another config override for both arms (repeatable)")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="default: bench/results/<this machine>/ablate_<path>_<workload>_<precision>.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print_result(child(json.loads(args.child)))
        return 0
    if args.path is None:
        parser.error("--path is required: one of " + ", ".join(NAMES))
    need_shared_data()
    workload = args.workload or ("w2" if args.path in W2_PATHS else "w1")
    rows = args.rows or (W1.rows if workload == "w1" else 48)
    resolved = precision(args.precision)
    info = describe_torch()
    print(headline(info), flush=True)
    settings = arms(args.path, training_device(), resolved)
    extra = [*EXTRA.get(args.path, []), *args.overrides]
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        if workload == "w1":
            data = write_nq_rows(rows, Path(tmp) / "nq.csv")
            print(f"{W1.describe(rows)}, {resolved}", flush=True)
        else:
            paths = w2_build(rows, Path(tmp))
            print(f"{W2.describe(rows)}, {resolved}", flush=True)

        def overrides(setting: str | list[str]) -> list[str]:
            if workload == "w1":
                return [*w1_overrides(data, resolved, 42, setting), *extra]
            return [*w2_overrides(paths["model"], paths["data"], resolved, 42, setting), *extra]

        for round_, arm in alternating(args.rounds, ["on", "off"]):
            spec = {"overrides": overrides(settings[arm] or "off"), "passes": args.passes, "warmup": args.warmup}
            result = child_result([sys.executable, __file__, "--child", json.dumps(spec)])
            runs[arm].append(result)
            print(f"round {round_ + 1} {args.path} {arm:3}: {result['seconds']:7.2f} s for {result['steps']} steps  "
                  f"{result['faults_per_step']:8.0f} page faults/step  peak RSS {result['peak_rss_mb']:.0f} MB  "
                  f"first loss {result['first_loss']:.6f}", flush=True)
            if round_ == 0 and arm == "on" and args.path not in result["on"]:
                print(f"{args.path} stays off here: {result['why_off'].get(args.path)}\n{result['speedups']}",
                      file=sys.stderr)
                return 1
            if len(runs["on"]) == len(runs["off"]):
                ratio = runs["off"][-1]["seconds"] / runs["on"][-1]["seconds"]
                print(f"round {round_ + 1}: with {args.path} x{ratio:.3f} faster", flush=True)
    ratios = [off["seconds"] / on["seconds"] for on, off in zip(runs["on"], runs["off"])]
    median = statistics.median(ratios)
    also = sorted(set(runs["on"][0]["on"]) - set(runs["off"][0]["on"]) - {args.path})
    print(f"\nsteps with {args.path} are x{median:.3f} faster (median of {', '.join(f'x{r:.3f}' for r in ratios)}); "
          f"{workload}, {rows} rows, {resolved}, {runs['on'][0]['batches']} batches")
    if also:
        print(f"turning {args.path} off also turned off: " + ", ".join(
            f"{name} ({runs['off'][0]['why_off'][name]})" for name in also))
    print(f"on:  {runs['on'][0]['speedups']}\noff: {runs['off'][0]['speedups']}")
    write_json(args.json or results_path(f"ablate_{args.path}_{workload}", f"_{resolved}"), {
        "probe": "ablate", "path": args.path, "workload": workload, "rows": rows, "precision": resolved,
        "machine": info, "passes": args.passes, "warmup": args.warmup, "overrides": extra,
        "settings": settings, "also_off": also, "runs": runs, "ratios": ratios, "median_ratio": median})
    return 0


if __name__ == "__main__":
    sys.exit(main())
