"""Does telling glibc's malloc to keep freed memory speed up CPU training? (It did here, so qatune does.)

A CPU training step allocates and frees hundreds of activation tensors; with glibc's defaults the
large ones are mmap'd and unmapped, and their pages faulted in again. Raising the mmap and trim
thresholds (mallopt, what jemalloc/tcmalloc preloading is usually recommended for) keeps them in the
heap; qatune.train.device.keep_freed_memory does that when training starts on CPU. This runs the W1
training loop (see generative_vs_trainer.py) in fresh processes, alternating qatune as it is ("on") and
qatune with that call taken out ("off"), and prints minor page faults, kernel (system) CPU time and
wall time per optimizer step (averaged over the whole epoch, the first steps' heap growth included),
the peak RSS of each process, their means per setting, and writes them to bench/cpu_allocator.json
with the CPU they ran on.

    python bench/cpu_allocator.py                  # ~4 minutes on 2 CPU cores
    python bench/cpu_allocator.py --precision fp32 --json bench/cpu_allocator_fp32.json
    python bench/cpu_allocator.py --rows 200 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import generative_vs_trainer as w1
from bench_machine import describe_torch, headline, json_option, write_json  # bench/ is on sys.path

TRAIN = ["train.epochs=1", "train.batch_size=16", "train.learning_rate=5e-4", "train.weight_decay=0.0", "seed=42"]
METRICS = ["faults", "system_ms", "wall_ms", "peak_rss_mb"]


def child(args, paths: dict) -> dict:
    import qatune.train
    import qatune.train.loop
    from qatune.config import load_config

    if not args.keep:
        qatune.train.loop.keep_freed_memory = lambda: False
    config = load_config(None, [f"model.name_or_path={paths['model']}", f"data.train_file={paths['data']}", *TRAIN,
                                f"train.precision={args.precision}"])
    prepared = qatune.train.prepare(config)
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    steps = qatune.train.fit(prepared, None, progress=False)["steps"]
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {"steps": steps, "faults": (after.ru_minflt - before.ru_minflt) / steps,
            "system_ms": 1000 * (after.ru_stime - before.ru_stime) / steps, "wall_ms": 1000 * seconds / steps,
            "peak_rss_mb": after.ru_maxrss / 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="train.precision of the runs (auto: bf16 where the CPU does it natively)")
    json_option(parser, __file__)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args, json.loads(args.child))), flush=True)
        return 0
    info = describe_torch()
    print(headline(info), flush=True)
    if not w1.SHARED.exists():
        print(f"needs the shared datasets at {w1.SHARED}", file=sys.stderr)
        return 1
    setup_args = argparse.Namespace(rows=args.rows, vocab=4096, seed=42)
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        paths = w1.setup(setup_args, Path(tmp))
        for round_ in range(args.rounds):
            for keep in ((True, False) if round_ % 2 == 0 else (False, True)):
                command = [sys.executable, __file__, "--child", json.dumps(paths), "--precision", args.precision,
                           *(["--keep"] if keep else [])]
                done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parent, check=False)
                line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                    return 1
                r = json.loads(line[len("RESULT "):])
                runs["on" if keep else "off"].append(r)
                print(f"round {round_ + 1} glibc keeps freed memory {'on ' if keep else 'off'}: "
                      f"{r['faults']:8.0f} page faults/step  {r['system_ms']:5.1f} ms kernel CPU/step  "
                      f"{r['wall_ms']:6.1f} ms wall/step "
                      f"({r['steps']} steps)  peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
    means = {setting: {m: statistics.mean(r[m] for r in results) for m in METRICS} for setting, results in runs.items()}
    print()
    for setting, mean in means.items():
        print(f"mean of rounds, glibc keeps freed memory {setting:3}: {mean['faults']:8.0f} page faults/step  "
              f"{mean['system_ms']:5.1f} ms kernel CPU/step  {mean['wall_ms']:6.1f} ms wall/step  "
              f"peak RSS {mean['peak_rss_mb']:.0f} MB")
    ratio = means["on"]["wall_ms"] / means["off"]["wall_ms"]
    print(f"wall time per step, on / off: x{ratio:.2f}")
    parameters = {"rows": args.rows, "rounds": args.rounds, "precision": args.precision, "vocab": setup_args.vocab,
                  "model_params": paths["params"],
                  "train": TRAIN}
    write_json(args.json, {"machine": info, "parameters": parameters, "runs": runs, "means": means,
                           "wall_ratio_on_off": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
