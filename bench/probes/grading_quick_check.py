"""Verdict accuracy and score MAE of a grading run (or one of its checkpoints) on one split, in ~5 minutes on 2
cores: greedy answers cut at 16 new tokens, enough for the "Verdict:" and "Score:" lines of
configs/smollm2-grading.yaml's template (the feedback is not written, so not scored). bench/quality/grading.py
scores every field of every split and the baselines; this is the quick look between training runs.

    python bench/quality/grading_data.py --write /tmp/saf      # the split of bench/quality/grading.py
    qatune train --config configs/smollm2-grading.yaml --output-dir /tmp/run --set data.train_file=/tmp/saf/train.csv \
        --set data.eval_file=null --set train.epochs=1
    python bench/probes/grading_quick_check.py /tmp/run /tmp/saf/unseen_answers.csv
    python bench/probes/grading_quick_check.py /tmp/run/checkpoints/step-0000187 /tmp/saf/unseen_answers.csv
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd
from bench_machine import describe, headline

from qatune.config import GenerateConfig
from qatune.inference.run_model import load_run_model
from qatune.kinds import answer_questions


def line(output: str, key: str) -> str | None:
    found = re.search(key + r": ([^\n]*)", output)
    return found.group(1).strip() if found else None


def number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run directory or one of its checkpoints")
    parser.add_argument("split", help="a CSV of grading_data.py's split (unseen_answers.csv, unseen_questions.csv)")
    parser.add_argument("--model", default="final", choices=["final", "best"])
    args = parser.parse_args()
    print(headline(describe()))
    start = time.perf_counter()
    rows = pd.read_csv(args.split, keep_default_na=False)
    loaded = load_run_model(args.run, args.model)
    fields = [{"reference_answer": r.reference_answer, "student_answer": r.student_answer} for r in rows.itertuples()]
    outputs = answer_questions(loaded.model, loaded.tokenizer, loaded.info, list(rows.question), None,
                               GenerateConfig(max_new_tokens=16), 32, False, fields=fields)
    verdicts = [line(o, "Verdict") for o in outputs]
    scores = pd.Series([number(line(o, "Score")) for o in outputs], dtype=float)
    print("verdicts written:", dict(collections.Counter(verdicts)))
    print(f"verdict accuracy {100 * (pd.Series(verdicts) == rows.label).mean():.1f}%  "
          f"score MAE {(scores - rows.score).abs().mean():.3f}  scores that do not parse {int(scores.isna().sum())}  "
          f"({len(rows)} rows, {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
