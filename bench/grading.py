"""Grading SAF answers: SmolLM2-135M fine-tuned with configs/smollm2-grading.yaml against the baselines a grader
would try first, per field (score, verdict, feedback) and per split (unseen answers to known questions; unseen
questions).

1. The split of grading_data.py (seeded): whole questions held out for "unseen questions", 15% of each remaining
   question's answers for "unseen answers", the rest to train on.
2. Baselines (grading_baselines.py): the majority verdict, the per-question majority verdict, the per-question mean
   score, and the nearest training answer's score, verdict and feedback (TF-IDF, same question first).
3. The base model zero-shot (``qatune eval --base``) and the fine-tuned run (``qatune train`` on the training split
   with the shipped config, then ``qatune eval`` on each split), on the same rows.

Every arm is scored by qatune's own field metrics (qatune.inference.field_metrics): verdict accuracy and macro-F1,
score MAE and within-tolerance, feedback token F1, ROUGE-L and BLEU, and the share of outputs that parse.

Writes bench/results/<this machine>/grading.json.

    python bench/grading.py --epochs 1                   # ~1 h on 2 cores (training <= 30 min)
    python bench/grading.py --epochs 1 --base-from bench/results/epyc-avx512-bf16/grading.json   # ~40 min
    python bench/grading.py --train-rows 300 --eval-rows 40 --json /tmp/grading.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may come from a model hub

import grading_baselines
from bench_machine import CHILD_ENV, ROOT, describe, headline, json_option, results_path, write_json
from grading_data import saf_split, write_csv

from qatune.inference.field_metrics import grading_metrics

STEM = "grading"
CONFIG = ROOT / "configs" / "smollm2-grading.yaml"
FIELDS = ("score", "label", "feedback")
KINDS = {"score": "number", "label": "label", "feedback": "text"}
SPLITS = ("unseen_answers", "unseen_questions")
BASELINES = ("majority_label", "question_majority_label", "question_mean_score", "nearest_feedback")


def qatune(args: list[str]) -> str:
    done = subprocess.run([sys.executable, "-m", "qatune", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **CHILD_ENV})
    if done.returncode != 0:
        raise SystemExit(f"qatune {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def summary(metrics: dict) -> dict:
    """The figures the table shows, from grading_metrics' (or qatune eval --json's) fields."""
    fields = metrics["fields"]
    return {"parse_rate": metrics["parse_rate"], "verdict_accuracy": fields["label"]["accuracy"],
            "verdict_macro_f1": fields["label"]["macro_f1"], "score_mae": fields["score"]["mae"],
            "score_within_tolerance": fields["score"]["within_tolerance"],
            "feedback_token_f1": fields["feedback"]["token_f1"], "feedback_rouge_l": fields["feedback"]["rouge_l"],
            "feedback_bleu": fields["feedback"]["bleu"]}


def prompt_settings() -> dict:
    """What the base model's answers depend on: the model, the prompt, the answer template and generation."""
    import yaml

    config = yaml.safe_load(CONFIG.read_text())
    data = config["data"]
    keys = ("question_column", "answer_columns", "answer_template", "prompt_template", "system_prompt", "user_template")
    return {"model": config["model"], "data": {key: data.get(key) for key in keys}, "generate": config["generate"]}


def baselines(splits: dict) -> dict:
    out = {}
    for split in SPLITS:
        test = splits[split]
        golds = [{f: grading_baselines.score_text(r.score) if f == "score" else str(getattr(r, f)) for f in FIELDS}
                 for r in test.itertuples()]
        for name in BASELINES:
            predictions = getattr(grading_baselines, name)(splits["train"], test)
            out.setdefault(name, {})[split] = summary(grading_metrics(KINDS, predictions, golds)) | {
                "full": grading_metrics(KINDS, predictions, golds)}
    return out


def evaluate(target: list[str], data: Path) -> dict:
    metrics = json.loads(qatune(["eval", *target, "--data", str(data), "--json"]))
    return summary(metrics) | {"full": metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-rows", type=int, default=None, help="train on the first N training rows")
    parser.add_argument("--eval-rows", type=int, default=None, help="score the first N rows of each split")
    parser.add_argument("--epochs", type=int, default=None, help="train.epochs (default: the config's)")
    parser.add_argument("--run", type=Path, default=None, help="a finished run of this split to score")
    parser.add_argument("--skip-base", action="store_true", help="leave out the zero-shot base model")
    parser.add_argument("--base-from", type=Path, default=None, metavar="JSON",
                        help="take the zero-shot base model's figures from an earlier grading.json of the same split, "
                             "model, prompt and generate settings (it only changes with them; ~20 min on 2 cores)")
    json_option(parser, STEM)
    args = parser.parse_args()
    machine = describe()
    print(headline(machine), flush=True)
    splits = saf_split()
    if args.train_rows:
        splits["train"] = splits["train"].sample(n=min(args.train_rows, len(splits["train"])), random_state=0)
    if args.eval_rows:
        splits = {k: (v.head(args.eval_rows) if k in SPLITS else v) for k, v in splits.items()}
    result = {"machine": machine, "config": str(CONFIG.relative_to(ROOT)), "prompt": prompt_settings(),
              "rows": {k: len(v) for k, v in splits.items()}, "arms": baselines(splits)}
    for name in BASELINES:
        print(f"{name:24s}", {s: {k: v for k, v in result['arms'][name][s].items() if k != 'full'} for s in SPLITS},
              flush=True)
    with tempfile.TemporaryDirectory(prefix="qatune-grading-") as tmp:
        tmp = Path(tmp)
        for name, frame in splits.items():
            write_csv(frame, tmp / f"{name}.csv")
        sets = ["--set", f"data.train_file={tmp / 'train.csv'}", "--set", "data.eval_file=null"]
        if args.epochs:
            sets += ["--set", f"train.epochs={args.epochs}"]
        if args.base_from is not None:
            earlier = json.loads(args.base_from.read_text())
            if earlier["rows"] != result["rows"] or earlier.get("prompt") not in (None, prompt_settings()):
                raise SystemExit(f"{args.base_from}: another split or prompt; its base model figures do not apply")
            result["arms"]["base zero-shot"] = earlier["arms"]["base zero-shot"]
            result["base_measured"] = earlier.get("base_measured", earlier["measured"])
        elif not args.skip_base:
            result["arms"]["base zero-shot"] = {
                split: evaluate(["--base", "--config", str(CONFIG), *sets], tmp / f"{split}.csv") for split in SPLITS}
            print("base zero-shot", {s: result["arms"]["base zero-shot"][s]["verdict_accuracy"] for s in SPLITS},
                  flush=True)
        run = args.run
        if run is not None:
            result["run"] = str(run)
        else:
            run = tmp / "run"
            start = time.perf_counter()
            qatune(["train", "--config", str(CONFIG), "--output-dir", str(run), "--quiet", *sets])
            result["train_seconds"] = round(time.perf_counter() - start, 1)
            result["train_result"] = json.loads((run / "run.json").read_text())["result"]
            print(f"trained in {result['train_seconds']:.0f} s", flush=True)
        result["arms"]["fine-tuned"] = {split: evaluate([str(run)], tmp / f"{split}.csv") for split in SPLITS}
    for name, arm in result["arms"].items():
        for split in SPLITS:
            shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in arm[split].items() if k != "full"}
            print(f"{name:24s} {split:17s} {shown}", flush=True)
    write_json(args.json or results_path(STEM), result)


if __name__ == "__main__":
    main()
