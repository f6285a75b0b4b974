"""Other ways of reading a trained grader's verdict and score, measured on kept runs of bench/grading.py without
retraining: does the grader's own probability, read differently, give better verdicts?

``scorer RUN SPLITS``: a scorer with a verdict head and a score head choosing among values (configs/minilm-scoring.yaml)
  A  as shipped: the verdict head's most likely class, the score head's median;
  B  verdict and score chosen together, among the (verdict, score) pairs some training row had;
  C  the same among the pairs the training rows of the row's question had (B for a question training never saw);
  D  the median score, its verdict the one training gave that score most often for the row's question.
``grader RUN SPLITS``: a generative grader choosing its verdict (configs/smollm2-grading.yaml); the verdict only (no
  feedback written): as shipped, the most likely verdict, against the same divided by the model's average verdict
  distribution over 300 training rows (contextual calibration).

SPLITS is the folder bench/grading.py --keep wrote (train.csv, unseen_answers.csv, unseen_questions.csv):

    python bench/grading.py --arms minilm-scoring --seeds 3 --json /tmp/g.json --keep /tmp/runs
    python bench/probes/grading_decodings.py scorer /tmp/runs/minilm-scoring-42 /tmp/runs --json /tmp/decodings.json
    python bench/probes/grading_decodings.py grader /tmp/runs/smollm2-grading-43 /tmp/runs --json /tmp/decodings.json
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd
import torch
from bench_machine import describe, headline

from qatune.data.generative import PromptEncoder
from qatune.data.grading_fields import AnswerTemplate
from qatune.data.scoring import ScoringCollator, ScoringEncoder
from qatune.data.spreadsheet import load_from_config
from qatune.data.templates import PromptTemplate
from qatune.inference import field_choice
from qatune.inference import generate as generation
from qatune.inference.batches import inference_precision
from qatune.inference.run_model import load_run_model
from qatune.model.scoring import HeadLayout

SPLITS = ("unseen_answers", "unseen_questions")


def read(folder: Path, name: str) -> pd.DataFrame:
    return pd.read_csv(folder / f"{name}.csv", dtype=str).fillna("")


def verdict_metrics(predicted: list[str], gold: list[str], classes: tuple[str, ...]) -> dict:
    f1 = []
    for value in classes:
        tp = sum(p == value and g == value for p, g in zip(predicted, gold))
        wrong = sum((p == value) != (g == value) for p, g in zip(predicted, gold))
        f1.append(2 * tp / (2 * tp + wrong) if tp else 0.0)
    return {"verdict_accuracy": round(100 * sum(p == g for p, g in zip(predicted, gold)) / len(gold), 1),
            "verdict_macro_f1": round(100 * sum(f1) / len(f1), 1), "verdicts": dict(collections.Counter(predicted))}


def scorer(run: Path, folder: Path) -> dict:
    loaded = load_run_model(run)
    model, info = loaded.model.eval(), loaded.info
    layout, specs = HeadLayout.from_json(info.scoring_heads), info.specs()
    verdict, score = layout.heads
    assert verdict.kind == "label" and score.by_values, "a verdict head and a score head choosing among values"
    numbers = score.numbers()

    def nearest(text: str) -> int:
        return min(range(len(numbers)), key=lambda i: abs(numbers[i] - float(text)))

    train = read(folder, "train")
    seen = [(verdict.classes.index(v), nearest(s), q) for v, s, q in zip(train["label"], train["score"],
                                                                        train["question"]) if v in verdict.classes]
    anywhere = collections.Counter((v, s) for v, s, _ in seen)
    per_question: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for v, s, q in seen:
        per_question[q][(v, s)] += 1
    encoder = ScoringEncoder(loaded.tokenizer, PromptTemplate(info.prompt_template, answer_prefix=""))
    collate = ScoringCollator(loaded.tokenizer.pad_token_id)
    out: dict = {"seed": loaded.config.seed}
    for split in SPLITS:
        gold = read(folder, split)
        records, _ = load_from_config(loaded.config.data, folder / f"{split}.csv")
        examples, _ = encoder.encode(records, [layout.targets(r.answer_fields, specs) for r in records],
                                     info.max_length)
        logits = [None] * len(records)
        order = sorted(range(len(examples)), key=lambda i: len(examples[i]))
        for start in range(0, len(order), 32):
            chunk = order[start:start + 32]
            batch = collate([examples[i] for i in chunk])
            with torch.inference_mode(), inference_precision("auto", torch.device("cpu")):
                rows = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
            for i, row in zip(chunk, rows):
                logits[i] = row
        z = torch.stack(logits)
        p_verdict = torch.log_softmax(z[:, verdict.start:verdict.stop], -1)
        p_score = torch.log_softmax(z[:, score.start:score.stop], -1)
        median = (p_score.exp().cumsum(-1) < 0.5).sum(-1).clamp(max=score.width - 1).tolist()
        ways = {"A_as_shipped": [(int(v), m) for v, m in zip(p_verdict.argmax(-1), median)]}
        for name, pairs in (("B_together_any_pair", lambda q: anywhere),
                            ("C_together_the_questions_pairs", lambda q: per_question.get(q) or anywhere)):
            ways[name] = [max(pairs(q), key=lambda p, r=r: float(p_verdict[r, p[0]] + p_score[r, p[1]]))
                          for r, q in enumerate(gold["question"])]
        from_score = []
        for r, q in enumerate(gold["question"]):
            given = [(count, v) for (v, s), count in (per_question.get(q) or anywhere).items() if s == median[r]]
            from_score.append((max(given)[1] if given else int(p_verdict[r].argmax()), median[r]))
        ways["D_verdict_from_the_score"] = from_score
        out[split] = {}
        for name, chosen in ways.items():
            predicted = [verdict.classes[v] for v, _ in chosen]
            mae = sum(abs(numbers[s] - float(g)) for (_, s), g in zip(chosen, gold["score"])) / len(gold)
            out[split][name] = {**verdict_metrics(predicted, list(gold["label"]), verdict.classes),
                                "score_mae": round(mae, 3)}
    return out


def grader(run: Path, folder: Path) -> dict:
    loaded = load_run_model(run)
    model, tokenizer, info = loaded.model, loaded.tokenizer, loaded.info
    values = info.specs()["label"].values
    device = next(model.parameters()).device
    scores: list[list[float]] = []

    @torch.inference_mode()
    def verdicts_only(model, tokenizer, info, prompts, generate, free_text):
        literals, names = AnswerTemplate.make(list(info.answer_fields), info.answer_template).pieces()
        assert names[0] == "label", names
        encoder = PromptEncoder(tokenizer, PromptTemplate(info.prompt_template, info.answer_prefix))
        for prompt in prompts:
            read = field_choice.read_prompt(model, prompt, device, generate.precision)
            row = field_choice.value_scores(model, encoder, read, literals[0], values, literals[1], False, device,
                                            generate.precision)
            total = math.log(sum(math.exp(s) for s in row))
            scores.append([s - total for s in row])
        return [""] * len(prompts)

    generation.write_answers = verdicts_only  # generate_answers' prompts, the verdict's likelihoods kept

    def verdict_scores(frame: pd.DataFrame) -> list[list[float]]:
        scores.clear()
        fields = [{c: str(row[c]) for c in frame.columns if c != "question"} for _, row in frame.iterrows()]
        generation.generate_answers(model, tokenizer, info, list(frame["question"]), [None] * len(frame),
                                    loaded.config.generate, 8, False, fields)
        return list(scores)

    training = verdict_scores(read(folder, "train").sample(n=300, random_state=0))
    prior = [math.log(sum(math.exp(row[k]) for row in training) / len(training)) for k in range(len(values))]
    average = {value: round(math.exp(p), 3) for value, p in zip(values, prior)}
    out = {"seed": loaded.config.seed, "average_verdict_distribution_on_300_training_rows": average}
    for split in SPLITS:
        gold = read(folder, split)
        rows = verdict_scores(gold)
        plain = [values[max(range(len(values)), key=row.__getitem__)] for row in rows]
        calibrated = [values[max(range(len(values)), key=lambda k, row=row: row[k] - prior[k])] for row in rows]
        out[split] = {"as_shipped": verdict_metrics(plain, list(gold["label"]), values),
                      "calibrated": verdict_metrics(calibrated, list(gold["label"]), values)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("scorer", "grader"))
    parser.add_argument("run", type=Path)
    parser.add_argument("splits", type=Path, help="the folder bench/grading.py --keep wrote")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the figures to this file; one written before keeps its other runs' figures")
    args = parser.parse_args()
    machine = describe()
    print(headline(machine), flush=True)
    measured = (scorer if args.kind == "scorer" else grader)(args.run, args.splits)
    print(json.dumps(measured, indent=1))
    if args.json:
        result = json.loads(args.json.read_text()) if args.json.is_file() else {"what": __doc__.split("\n\n")[0]}
        result["cpu"] = machine
        result.setdefault(args.kind, {})[f"seed {measured.pop('seed')}"] = {"run": str(args.run), **measured}
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
