"""Averaged weights against the last ones, without retraining: a kept run of bench/grading.py that saved a
checkpoint every few steps (``--set train.save_every=10 --set train.keep_checkpoints=1000``), its snapshots
averaged afterwards and each average scored like the run's own final/.

Averages (each over the snapshots at multiples of the save interval, the last one included):
  last          the last snapshot alone (final/'s weights)
  ema_D         an exponential moving average with decay D per optimizer step (D**k per snapshot k steps apart),
                started at the first snapshot
  tail_E        the plain mean of the snapshots of the last E epochs

Each is written as a model folder (final/ with its model.safetensors replaced) and scored by
bench/probes/grading_decodings.py's scorer reading (A_as_shipped is qatune's own decoding) on the splits.

    python bench/grading.py --arms minilm-scoring --seeds 3 --set train.save_every=10 \\
        --set train.keep_checkpoints=1000 --json /tmp/g.json --keep /tmp/runs     # (checkpoints kept)
    python bench/probes/weight_averaging.py /tmp/runs/minilm-scoring-42 /tmp/runs --json /tmp/averaging.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import grading_decodings
import torch
import yaml
from bench_machine import describe, headline
from safetensors.torch import load_file, save_file

from qatune.runs import atomic

SNAPSHOT = re.compile(r"^step-(\d+)$")


def snapshots(run: Path, every: int, last: int) -> list[tuple[int, Path]]:
    """The checkpoints at multiples of ``every`` up to step ``last``, and the one at ``last`` (an epoch's end)."""
    found = [(int(m.group(1)), p) for p in (run / "checkpoints").iterdir() if (m := SNAPSHOT.match(p.name))]
    return sorted((step, p / "model.safetensors") for step, p in found
                  if step <= last and (step % every == 0 or step == last))


def averages(shots: list[tuple[int, Path]], steps_per_epoch: int, decays: list[float], tails: list[int]) -> dict:
    """Every average, in one pass over the snapshots."""
    last_step = shots[-1][0]
    ema: dict[float, dict[str, torch.Tensor]] = {}
    tail_sum: dict[int, dict[str, torch.Tensor]] = {}
    tail_count = dict.fromkeys(tails, 0)
    previous = None
    weights: dict[str, torch.Tensor] = {}
    for step, path in shots:
        weights = load_file(path)
        for decay in decays:
            if decay not in ema:
                ema[decay] = {k: v.clone().float() for k, v in weights.items()}
            else:
                keep = decay ** (step - previous)
                for k, v in weights.items():
                    ema[decay][k].mul_(keep).add_(v.float(), alpha=1 - keep)
        for epochs in tails:
            if step > last_step - epochs * steps_per_epoch:
                if epochs not in tail_sum:
                    tail_sum[epochs] = {k: v.clone().float() for k, v in weights.items()}
                else:
                    for k, v in weights.items():
                        tail_sum[epochs][k].add_(v.float())
                tail_count[epochs] += 1
        previous = step
    out = {"last": weights}
    out |= {f"ema_{decay}": averaged for decay, averaged in ema.items()}
    out |= {f"tail_{epochs}": {k: v / tail_count[epochs] for k, v in summed.items()}
            for epochs, summed in tail_sum.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("splits", type=Path, help="the folder bench/grading.py --keep wrote")
    parser.add_argument("--every", type=int, default=10, help="the run's train.save_every")
    parser.add_argument("--decays", default="0.99,0.995", help="comma-separated EMA decays per step")
    parser.add_argument("--tails", default="2", help="comma-separated numbers of last epochs to average")
    parser.add_argument("--epochs", default=None,
                        help="comma-separated: average what training had done after these epochs (default: all)")
    parser.add_argument("--splits-scored", default=",".join(grading_decodings.SPLITS))
    parser.add_argument("--json", type=Path, default=None,
                        help="write the figures to this file; one written before keeps its other runs' figures")
    args = parser.parse_args()
    machine = describe()
    print(headline(machine), flush=True)
    steps = json.loads((args.run / "run.json").read_text())["result"]["steps"]
    epochs = yaml.safe_load((args.run / "config.yaml").read_text())["train"]["epochs"]
    steps_per_epoch = steps // epochs
    grading_decodings.SPLITS = tuple(args.splits_scored.split(","))
    measured: dict = {"run": str(args.run), "snapshots_every": args.every, "steps": steps, "epochs": epochs}
    for cut in sorted({int(c) for c in args.epochs.split(",")} if args.epochs else {epochs}):
        last = cut * steps_per_epoch if cut < epochs else steps
        shots = snapshots(args.run, args.every, last)
        print(f"after epoch {cut}: {len(shots)} snapshots up to step {last}", flush=True)
        variants = averages(shots, steps_per_epoch, [float(d) for d in args.decays.split(",")],
                            [int(t) for t in args.tails.split(",")])
        with tempfile.TemporaryDirectory(prefix="qatune-averaging-") as tmp:
            for name, weights in variants.items():
                folder = Path(tmp) / name
                shutil.copytree(args.run / "final", folder)
                save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors",
                          metadata={"format": "pt"})
                atomic.write_manifest(folder)  # the folder's files changed
                start = time.perf_counter()
                scored = grading_decodings.scorer(folder, args.splits)
                seed = scored.pop("seed")
                figures = {split: shown["A_as_shipped"] for split, shown in scored.items()}
                measured.setdefault(f"epochs {cut}", {})[name] = figures
                print(f"seed {seed} epochs {cut} {name} ({time.perf_counter() - start:.0f} s): {json.dumps(figures)}",
                      flush=True)
    if args.json:
        result = json.loads(args.json.read_text()) if args.json.is_file() else {"what": __doc__.split("\n\n")[0]}
        result["cpu"] = machine
        result.setdefault("runs", {})[f"seed {seed}"] = measured
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
