"""Rebuild the example and test-fixture slices from the shared datasets (../shared/data).

Run from the repository root: python examples/make_examples.py
The slices are committed; this script documents exactly how they were cut.
"""

from __future__ import annotations

import collections
import csv
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
QA_ROWS = 1000  # configs/smollm2-qa.yaml's training rows
DEMO_TRAIN_ROWS = 160
DEMO_EVAL_ROWS = 80


def read(name: str) -> list[dict[str, str]]:
    with open(SHARED / name, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def write(path: Path, rows: list[dict[str, str]], columns: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path.relative_to(ROOT)} ({len(rows)} rows)")


def faq_rows(n: int, skip: int = 0) -> list[dict[str, str]]:
    rows = [r for r in read("webquestions/webquestions.csv") if "http" not in r["answer"]]
    return rows[skip : skip + n]


def majority_answers(rows: list[dict[str, str]], all_answers: list[dict[str, str]]) -> list[dict[str, str]]:
    """Each row with the answer most of its annotators gave (ties: the shortest, then the first)."""
    out = []
    for row, gold in zip(rows, all_answers, strict=True):
        texts = [a["text"] for a in json.loads(gold["answers_json"])]
        counts = collections.Counter(texts)
        out.append({**row, "answer": min(texts, key=lambda t: (-counts[t], len(t), texts.index(t)))})
    return out


def grading_workbook(path: Path) -> None:
    """A sheet like the seed's: messy headers, a numeric marks column, a blank row, two sheets."""
    from openpyxl import Workbook

    rows = read("saf_feedback_en/saf_feedback_en.csv")[:40]
    book = Workbook()
    sheet = book.active
    sheet.title = "Marks"
    sheet.append([" Question", "Answer ", "Total Marks", "Feedback"])
    for i, row in enumerate(rows):
        if i == 10:
            sheet.append([None, None, None, None])
        sheet.append([row["question"], row["student_answer"], float(row["score"]), row["feedback"]])
    notes = book.create_sheet("Notes")
    notes.append(["Slice of SAF v2.0 (English), MIT / CC BY 4.0; see SOURCE.md"])
    book.save(path)
    print(f"wrote {path.relative_to(ROOT)} (40 rows + 1 blank row)")


def main() -> int:
    if not SHARED.exists():
        print(f"{SHARED} not found; the slices are already committed", file=sys.stderr)
        return 1
    data = ROOT / "examples" / "data"
    fixtures = ROOT / "tests" / "fixtures"
    write(data / "faq.csv", faq_rows(150), ["question", "answer"])
    grading_workbook(data / "grading.xlsx")
    write(data / "squadshifts_train.csv", read("squadshifts_new_wiki/squadshifts_new_wiki.csv")[:400],
          ["question", "context", "answer", "answer_start"])
    write(data / "xquad_eval.csv", read("xquad_en/xquad_en.csv")[:200],
          ["question", "context", "answer", "answer_start"])
    squad = "squadshifts_new_wiki/squadshifts_new_wiki"
    qa = majority_answers(read(f"{squad}.csv")[:QA_ROWS], read(f"{squad}_all_answers.csv")[:QA_ROWS])
    write(data / "squadshifts_qa.csv", qa, ["question", "context", "answer"])
    # make demo (configs/smollm2-demo.yaml): the first rows of the two files above, few enough for a few minutes
    # on 2 CPU cores, training and both evaluations included.
    write(data / "squadshifts_demo.csv", qa[:DEMO_TRAIN_ROWS], ["question", "context", "answer"])
    write(data / "xquad_demo.csv", read("xquad_en/xquad_en.csv")[:DEMO_EVAL_ROWS], ["question", "context", "answer"])
    write(fixtures / "faq100.csv", faq_rows(100, skip=200), ["question", "answer"])
    write(fixtures / "xquad_slice.csv", read("xquad_en/xquad_en.csv")[200:260], ["question", "context", "answer"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
