"""Would a moving average of the weights (train.ema_decay) answer the held-out reading-comprehension rows better
than the last weights do, and with which decay?

Trains configs/smollm2-qa.yaml once per seed (data.eval_file null, as the shipped run's numbers are measured)
with train.ema_decay set to the first of --decays, while the same run keeps the other decays' averages beside it
(exact, per optimizer step, as qatune's own average is kept: qatune.train.averaging). Then scores, on
examples/data/xquad_eval.csv with grounded decoding as shipped (generate.grounded auto: on for this data), the
last weights (the run's last checkpoint) and every average (final/ holds the first one; the others are written
into final/ in turn). One training run gives every arm, so the arms of a seed differ only in how its weights are
read.

    python bench/probes/qa_weight_averaging.py --seed 42 --out /tmp/ema42 --json /tmp/ema42.json   # ~30 min, 2 cores
    python bench/probes/qa_weight_averaging.py --combine /tmp/ema42.json /tmp/ema43.json ...        # mean and worst
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_machine import ROOT, describe_torch, headline, json_option, results_path, write_json

STEM = "qa_weight_averaging"
CONFIG = ROOT / "configs" / "smollm2-qa.yaml"


def keep_other_averages(decays: list[float], kept: list) -> None:
    """qatune's WeightAverage, as the loop makes it, also keeping an average for each of ``decays``."""
    import torch

    from qatune.train import averaging, loop

    class Several(averaging.WeightAverage):
        def __init__(self, params, decay):
            super().__init__(params, decay)
            self.others = {d: [p.detach().float().clone() for p in self.params] for d in decays if d != decay}
            kept.append(self)

        @torch.no_grad()
        def update(self, step: int) -> None:
            super().update(step)
            now = [p.detach().float() for p in self.params]
            for d, average in self.others.items():
                torch._foreach_lerp_(average, now, 1.0 - averaging.decay_at(d, step))

    loop.WeightAverage = Several


def names_of(averages: list, saved: dict) -> list[list[str]]:
    """The saved tensors' names of each averaged parameter (final/ holds the first decay's average: each of its
    tensors equals one of them; tied weights, if saved twice, two)."""
    import torch

    names = []
    for average in averages:
        match = [name for name, tensor in saved.items()
                 if tensor.shape == average.shape and torch.equal(tensor, average.to(tensor.dtype))]
        if not match:
            raise SystemExit(f"no saved tensor matches an averaged parameter of shape {tuple(average.shape)}")
        names.append(match)
    if sorted(n for group in names for n in group) != sorted(saved):
        raise SystemExit("the averaged parameters do not cover final/'s tensors one to one")
    return names


def combine(files: list[Path]) -> dict:
    """Several seeds' results side by side: each arm's F1 and EM by seed, their mean and worst over the seeds that
    have the arm."""
    runs = [json.loads(f.read_text(encoding="utf-8")) for f in files]
    arms = list(dict.fromkeys(arm for r in runs for arm in r["arms"]))
    summary = {}
    for arm in arms:
        having = [r for r in runs if arm in r["arms"]]
        f1 = [r["arms"][arm]["f1"] for r in having]
        em = [r["arms"][arm]["exact_match"] for r in having]
        summary[arm] = {"seeds": [r["seed"] for r in having], "f1": f1, "f1_mean": round(statistics.mean(f1), 2),
                        "f1_worst": min(f1), "exact_match": em,
                        "exact_match_mean": round(statistics.mean(em), 2)}
    return {"cpu": runs[0]["cpu"], "run": runs[0]["run"], "seeds": [r["seed"] for r in runs], "eval": runs[0]["eval"],
            "train_wall_s": [r["train_wall_s"] for r in runs], "arms": summary,
            "per_seed": {str(r["seed"]): r["arms"] for r in runs}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--out", type=Path, help="the run directory to train into (kept)")
    parser.add_argument("--decays", default="0.95,0.9,0.98,0.99",
                        help="the first is train.ema_decay (final/); the others are kept beside it")
    parser.add_argument("--eval-file", type=Path, default=ROOT / "examples" / "data" / "xquad_eval.csv")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="another config change (a quick try: --set train.max_steps=4)")
    parser.add_argument("--combine", type=Path, nargs="+", metavar="JSON")
    json_option(parser, STEM)
    args = parser.parse_args()
    if args.combine:
        write_json(args.json or results_path(STEM), combine(args.combine))
        return
    if args.seed is None or args.out is None:
        parser.error("--seed and --out are needed (or --combine)")

    from safetensors.torch import load_file, save_file

    from qatune.cli import main as qatune
    from qatune.inference.evaluate import evaluate_run
    from qatune.runs import atomic

    machine = describe_torch()
    print(headline(machine), flush=True)
    decays = [float(d) for d in args.decays.split(",")]
    kept: list = []
    keep_other_averages(decays, kept)
    start = time.perf_counter()
    code = qatune(["train", "--config", str(CONFIG), "--set", "data.eval_file=null", "--set", f"seed={args.seed}",
                   "--set", f"output_dir={args.out}", "--set", f"train.ema_decay={decays[0]}",
                   *[item for change in args.overrides for item in ("--set", change)]])
    train_s = time.perf_counter() - start
    if code:
        raise SystemExit(f"training failed ({code})")
    [average] = kept
    final = args.out / "final" / "model.safetensors"
    saved = load_file(final)
    names = names_of(average.averages, saved)
    last = max((args.out / "checkpoints").iterdir(), key=lambda p: p.name) / "model.safetensors"
    weights = {f"ema {decays[0]}": dict(saved), "last": load_file(last)}
    for decay, tensors in average.others.items():
        weights[f"ema {decay}"] = {n: t.to(saved[n].dtype) for group, t in zip(names, tensors) for n in group}
    arms = {}
    for arm, tensors in weights.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, final, metadata={"format": "pt"})
        atomic.write_manifest(final.parent)
        begun = time.perf_counter()
        metrics, _ = evaluate_run(args.out, args.eval_file, grounded="on")
        moved = max((tensors[n].float() - weights["last"][n].float()).abs().max().item() for n in tensors)
        arms[arm] = {"exact_match": round(metrics["exact_match"], 2), "f1": round(metrics["f1"], 2),
                     "eval_s": round(time.perf_counter() - begun, 1), "largest_difference_from_last": moved}
        print(f"seed {args.seed} {arm}: {json.dumps(arms[arm])}", flush=True)
    save_file({k: v.contiguous() for k, v in saved.items()}, final, metadata={"format": "pt"})  # as trained
    atomic.write_manifest(final.parent)
    write_json(args.json or results_path(STEM, f"_{args.seed}"),
               {"cpu": machine, "seed": args.seed, "train_wall_s": round(train_s),
                "run": f"{CONFIG.relative_to(ROOT)} with data.eval_file null, seed {args.seed}, "
                       f"train.ema_decay {decays[0]}; the other decays kept beside it",
                "eval": {"file": str(args.eval_file.resolve()).removeprefix(f"{ROOT}/"), "grounded": "on"},
                "arms": arms})


if __name__ == "__main__":
    main()
