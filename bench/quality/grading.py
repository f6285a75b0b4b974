"""Grading SAF answers: qatune's graders against the baselines a grader would try first, per field (verdict,
score, feedback) and per split (unseen answers to known questions; unseen questions), over several seeds.

1. The split of grading_data.py (seeded): whole questions held out for "unseen questions", 15% of each remaining
   question's answers for "unseen answers", the rest to train on.
2. Baselines (grading_baselines.py): the majority verdict, the per-question majority verdict, the per-question mean
   and median score, and the nearest training answer's score, verdict and feedback (TF-IDF, same question first).
3. Arms, each trained on the training split with its shipped config (``qatune train``, the seed set by --set seed)
   and scored on each split (``qatune eval``): minilm-scoring (configs/minilm-scoring.yaml: a scoring head on the
   packaged MiniLM), smollm2-scoring (configs/smollm2-scoring.yaml: the same on SmolLM2-135M) and smollm2-grading
   (configs/smollm2-grading.yaml: SmolLM2 writes verdict, score and feedback, the verdict and score chosen from the
   values training saw). Each arm's seeds are reported one by one, with their mean and their worst.
4. Optionally the base model zero-shot (``qatune eval --base`` with the generative grader's prompt).

Every arm is scored by qatune's own field metrics (qatune.inference.field_metrics): verdict accuracy and macro-F1,
score MAE and within-tolerance, feedback token F1, ROUGE-L and BLEU, and the share of outputs that parse.

Writes bench/results/<this machine>/grading.json after every seed (an interrupted run keeps what it measured;
--json FILE of an earlier run adds the arms and seeds asked for to it).

    python bench/quality/grading.py --arms minilm-scoring --seeds 3                    # ~30 min on 2 cores
    python bench/quality/grading.py --arms smollm2-grading --seeds 2 --json bench/results/epyc-avx512-bf16/grading.json
    python bench/quality/grading.py --arms minilm-scoring --seeds 1 --train-rows 300 --eval-rows 40 --json /tmp/g.json
    python bench/quality/grading.py --arms smollm2-grading --seeds 1 --train-rows 200 --eval-sample 50 \
        --set model.name_or_path=gemma3-270m --json bench/results/epyc-avx512-bf16/grading-200rows-gemma3.json
    python bench/quality/grading.py --arms smollm2-grading --seeds 2 --set model.name_or_path=gemma3-270m \
        --set train.learning_rate=5e-5 --json bench/results/epyc-avx512-bf16/grading-gemma3-grader.json   # ~2 h
    python bench/quality/grading.py --arms smollm2-grading --seeds 1 --json /tmp/g.json --keep /tmp/grading-runs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for bench_machine
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may come from a model hub

import grading_baselines
from bench_machine import CHILD_ENV, ROOT, describe, headline, json_option, results_path, write_json
from grading_data import saf_split, write_csv

from qatune.inference.field_metrics import grading_metrics

STEM = "grading"
ARMS = {"minilm-scoring": "configs/minilm-scoring.yaml", "smollm2-scoring": "configs/smollm2-scoring.yaml",
        "smollm2-grading": "configs/smollm2-grading.yaml"}
FIELDS = ("score", "label", "feedback")
KINDS = {"score": "number", "label": "label", "feedback": "text"}
SPLITS = ("unseen_answers", "unseen_questions")
BASELINES = ("majority_label", "question_majority_label", "question_mean_score", "question_median_score",
             "nearest_feedback")
FIRST_SEED = 42
RESUME_STATE = ("optimizer.pt", "scheduler.pt", "rng.pt")
"""What --keep leaves out of a run's checkpoints: what only resuming needs (the weights stay, so that the snapshots of
a run that saved a checkpoint every few steps can be averaged afterwards)."""
HIGHER_IS_BETTER = {"parse_rate": True, "verdict_accuracy": True, "verdict_macro_f1": True, "score_mae": False,
                    "score_within_tolerance": True, "feedback_token_f1": True, "feedback_rouge_l": True,
                    "feedback_bleu": True}


def qatune(args: list[str]) -> str:
    done = subprocess.run([sys.executable, "-m", "qatune", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **CHILD_ENV})
    if done.returncode != 0:
        raise SystemExit(f"qatune {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def summary(metrics: dict) -> dict:
    """The figures the table shows, from grading_metrics' (or qatune eval --json's) fields; feedback only where
    the arm writes it."""
    fields = metrics["fields"]
    out = {"parse_rate": metrics["parse_rate"], "verdict_accuracy": fields["label"]["accuracy"],
           "verdict_macro_f1": fields["label"]["macro_f1"], "score_mae": fields["score"]["mae"],
           "score_within_tolerance": fields["score"]["within_tolerance"]}
    if "feedback" in fields:
        out |= {"feedback_token_f1": fields["feedback"]["token_f1"], "feedback_rouge_l": fields["feedback"]["rouge_l"],
                "feedback_bleu": fields["feedback"]["bleu"]}
    return out


def over_seeds(seeds: list[dict]) -> tuple[dict, dict]:
    """The mean and the worst of each figure over an arm's seeds, per split (worst: the lowest accuracy, the
    highest error)."""
    mean, worst = {}, {}
    for split in SPLITS:
        figures = [seed[split] for seed in seeds]
        names = [name for name in figures[0] if name in HIGHER_IS_BETTER and figures[0][name] is not None]
        mean[split] = {name: statistics.fmean(f[name] for f in figures) for name in names}
        worst[split] = {name: (min if HIGHER_IS_BETTER[name] else max)(f[name] for f in figures) for name in names}
    return mean, worst


def prompt_settings(config: Path) -> dict:
    """What the base model's answers depend on: the model, the prompt, the answer template and generation."""
    import yaml

    loaded = yaml.safe_load(config.read_text())
    data = loaded["data"]
    keys = ("question_column", "answer_columns", "answer_template", "prompt_template", "system_prompt", "user_template")
    return {"model": loaded["model"], "data": {key: data.get(key) for key in keys}, "generate": loaded["generate"]}


def baselines(splits: dict) -> dict:
    out = {}
    for split in SPLITS:
        test = splits[split]
        golds = [{f: grading_baselines.score_text(r.score) if f == "score" else str(getattr(r, f)) for f in FIELDS}
                 for r in test.itertuples()]
        for name in BASELINES:
            predictions = getattr(grading_baselines, name)(splits["train"], test)
            metrics = grading_metrics(KINDS, predictions, golds)
            out.setdefault(name, {})[split] = summary(metrics) | {"full": metrics}
    return out


def evaluate(target: list[str], data: Path) -> dict:
    metrics = json.loads(qatune(["eval", *target, "--data", str(data), "--json"]))
    return summary(metrics) | {"full": metrics}


def train_and_score(arm: str, seed: int, tmp: Path, sets: list[str]) -> dict:
    run = tmp / f"{arm}-{seed}"
    start = time.perf_counter()
    qatune(["train", "--config", str(ROOT / ARMS[arm]), "--output-dir", str(run), "--quiet", "--set", f"seed={seed}",
            *sets])
    seconds = round(time.perf_counter() - start, 1)
    result = {"seed": seed, "train_seconds": seconds, "load_average_after_training": list(os.getloadavg()),
              "train_result": json.loads((run / "run.json").read_text())["result"]}
    for split in SPLITS:
        result[split] = evaluate([str(run)], tmp / f"{split}.csv")
    result["unparsed_answers"] = {split: unparsed_answers(run / f"predictions-{split}.csv") for split in SPLITS}
    return result


def unparsed_answers(predictions: Path, count: int = 5) -> list[str]:
    """The first answers of eval's predictions file that were not parsed whole, as the model wrote them."""
    import csv

    if not predictions.is_file():
        return []
    with predictions.open(encoding="utf-8", newline="") as file:
        return [row["prediction"] for row in csv.DictReader(file) if row.get("parsed") == "false"][:count]


def recipe_hash(config: Path) -> str:
    """What a config says, hashed: its comments and layout do not count."""
    import yaml

    settings = json.dumps(yaml.safe_load(config.read_text(encoding="utf-8")), sort_keys=True)
    return hashlib.sha256(settings.encode()).hexdigest()[:16]


def shown(figures: dict) -> dict:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in figures.items() if k != "full"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--seeds", type=int, default=3, help=f"seeds per arm: {FIRST_SEED}, {FIRST_SEED + 1}, ...")
    parser.add_argument("--first-seed", type=int, default=FIRST_SEED)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config change for every arm's training (recorded)")
    parser.add_argument("--train-rows", type=int, default=None, help="train on a sample of N training rows")
    parser.add_argument("--eval-rows", type=int, default=None, help="score the first N rows of each split")
    parser.add_argument("--eval-sample", type=int, default=None, metavar="N",
                        help="score a sample of N rows of each split, drawn across its questions (the first rows of a "
                             "split are the answers to one or two questions)")
    parser.add_argument("--similar", type=int, default=0, metavar="K",
                        help="add a column similar_graded to every split: the verdicts and scores of the row's K most "
                             "similar training answers to its question (for a prompt_template that reads it)")
    parser.add_argument("--similar-text", type=int, default=0, metavar="CHARS",
                        help="with --similar, the nearest answer's text too, cut to CHARS characters")
    parser.add_argument("--base", action="store_true", help="also score the generative grader's base model zero-shot")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="keep the splits' CSV files and each trained run in DIR (its checkpoints' weights, not "
                             "their optimizer state), to look into afterwards (by default they go with a temporary "
                             "folder)")
    json_option(parser, STEM)
    args = parser.parse_args()
    arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {', '.join(ARMS)}")
    path = args.json or results_path(STEM)
    machine = describe()
    print(headline(machine), flush=True)
    splits = saf_split()
    if args.train_rows:
        splits["train"] = splits["train"].sample(n=min(args.train_rows, len(splits["train"])), random_state=0)
    if args.eval_rows:
        splits = {k: (v.head(args.eval_rows) if k in SPLITS else v) for k, v in splits.items()}
    if args.eval_sample:
        splits = {k: (v.sample(n=min(args.eval_sample, len(v)), random_state=0).sort_index() if k in SPLITS else v)
                  for k, v in splits.items()}
    if args.similar:
        train = splits["train"]
        splits = {name: frame.assign(similar_graded=grading_baselines.similar_graded(
            train, frame, args.similar, args.similar_text)) for name, frame in splits.items()}
    rows = {k: len(v) for k, v in splits.items()}
    result = json.loads(path.read_text()) if path.is_file() else {}
    if result and result.get("rows") != rows:
        raise SystemExit(f"{path} holds another split ({result.get('rows')}); pass --json with a new file")
    result.update({"machine": machine, "rows": rows, "baselines": baselines(splits)})
    if args.train_rows or args.eval_rows or args.eval_sample:
        result["subset"] = {"train_rows": args.train_rows, "eval_rows": args.eval_rows, "eval_sample": args.eval_sample}
    result.setdefault("arms", {})
    for name in BASELINES:
        print(f"{name:24s}", {s: shown(result['baselines'][name][s]) for s in SPLITS}, flush=True)
    with tempfile.TemporaryDirectory(prefix="qatune-grading-") as tmp:
        tmp = Path(tmp)
        for name, frame in splits.items():
            write_csv(frame, tmp / f"{name}.csv")
        sets = [part for pair in [f"data.train_file={tmp / 'train.csv'}", "data.eval_file=null", *args.set]
                for part in ("--set", pair)]
        if args.base:
            config = ROOT / ARMS["smollm2-grading"]
            result["base zero-shot"] = {"prompt": prompt_settings(config)} | {
                split: evaluate(["--base", "--config", str(config), *sets], tmp / f"{split}.csv") for split in SPLITS}
            write_json(path, result)
        for arm in arms:
            recipe = recipe_hash(ROOT / ARMS[arm])
            entry = result["arms"].setdefault(arm, {"config": ARMS[arm], "config_sha256": recipe, "sets": args.set,
                                                    "seeds": []})
            if entry.get("sets") != args.set or entry.get("config_sha256", recipe) != recipe:
                raise SystemExit(f"{path}: arm {arm} was measured with another {ARMS[arm]} or --set "
                                 f"{entry.get('sets')} (this run: {args.set}); pass --json with a new file, or "
                                 f"remove the arm from it")
            done = {seed["seed"] for seed in entry["seeds"]}
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                if seed in done:
                    continue
                measured = train_and_score(arm, seed, tmp, sets)
                if args.keep:
                    shutil.copytree(tmp, args.keep, ignore=shutil.ignore_patterns(*RESUME_STATE), dirs_exist_ok=True)
                entry["seeds"].append(measured)
                entry["mean"], entry["worst"] = over_seeds(entry["seeds"])
                write_json(path, result)
                print(f"{arm} seed {seed}: trained in {measured['train_seconds']:.0f} s; "
                      + "; ".join(f"{split} {shown(measured[split])}" for split in SPLITS), flush=True)
            print(f"{arm}: mean {entry['mean']}\n{arm}: worst {entry['worst']}", flush=True)


if __name__ == "__main__":
    main()
