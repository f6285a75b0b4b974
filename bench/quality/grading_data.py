"""Grading splits of SAF v2.0 (English): train, unseen answers, unseen questions.

A grader reads question + reference answer + student answer and writes a score, a verdict label and feedback.
The shared part of SAF (../shared/data/saf_feedback_en) holds SAF's training material only: 2,127 answers to
26 questions. This cuts it the way SAF's own test sets are cut, deterministically from a seed:

unseen_questions  whole questions held out (4-5 of the 26, 15-20% of the rows) from a seeded shuffle of the
                  question ids, redrawn until each label makes up at least MIN_LABEL_SHARE of their rows
unseen_answers    UNSEEN_ANSWER_SHARE of each remaining question's answers, sampled per question
train             the rest

    python bench/quality/grading_data.py                       # sizes and labels of the splits; writes nothing
    python bench/quality/grading_data.py --write /tmp/saf      # also writes train.csv, unseen_answers.csv, ...
    python bench/quality/grading_data.py --examples examples/grading   # rebuilds the example sheet (train, eval, xlsx)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for workloads

import numpy as np
import pandas as pd
from workloads import SHARED, need_shared_data

SAF_CSV = SHARED / "saf_feedback_en" / "saf_feedback_en.csv"
LABELS = ("Correct", "Partially correct", "Incorrect")
HELD_QUESTION_SHARE = (0.15, 0.20)
HELD_QUESTION_COUNT = (4, 5)
MIN_LABEL_SHARE = 0.05
UNSEEN_ANSWER_SHARE = 0.15

EXAMPLE_QUESTIONS = 6  # the questions with the shortest student answers (median characters) among train's
EXAMPLE_MAX_CORRECT_SHARE = 0.85  # ... leaving out those nearly all answered correctly: the sheet needs every verdict
EXAMPLE_TRAIN_ROWS = 240
EXAMPLE_EVAL_ROWS = 60
EXAMPLE_COLUMNS = ["question_id", "question", "reference_answer", "student_answer", "score", "label", "feedback"]
EXAMPLE_SHEET_ROWS = 10


def read_saf(path: Path = SAF_CSV) -> pd.DataFrame:
    # keep_default_na=False: answers such as "None" or "NA" stay strings
    return pd.read_csv(path, keep_default_na=False)


def write_csv(frame: pd.DataFrame, path: Path) -> None:
    """UTF-8, CRLF row ends (RFC 4180, as the source and examples/data/); newlines inside answers stay quoted."""
    frame.to_csv(path, index=False, encoding="utf-8", lineterminator="\r\n")
    print(f"wrote {path} ({len(frame)} rows)")


def held_out_questions(data: pd.DataFrame, seed: int) -> list[str]:
    """The question ids of unseen_questions: the shortest prefix of a seeded shuffle holding 15% of the rows,
    reshuffled until that prefix also has 4-5 questions, at most 20% of the rows and every label's share."""
    rows = data.groupby("question_id").size()
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        order = list(rng.permutation(sorted(rows.index)))
        shares = rows[order].cumsum() / len(data)
        held = order[: int((shares < HELD_QUESTION_SHARE[0]).sum()) + 1]
        labels = data.loc[data.question_id.isin(held), "label"].value_counts(normalize=True)
        if (HELD_QUESTION_COUNT[0] <= len(held) <= HELD_QUESTION_COUNT[1]
                and shares[held[-1]] <= HELD_QUESTION_SHARE[1]
                and all(labels.get(label, 0.0) >= MIN_LABEL_SHARE for label in LABELS)):
            return sorted(held)
    raise ValueError(f"no shuffle of {len(rows)} questions with seed {seed} meets the held-out rules; try another seed")


def saf_split(path: Path = SAF_CSV, seed: int = 0) -> dict[str, pd.DataFrame]:
    """{"train", "unseen_answers", "unseen_questions"}: disjoint, covering every row, each in file order."""
    data = read_saf(path)
    held = data.question_id.isin(held_out_questions(data, seed))
    seen = data[~held]
    unseen_answers = seen.groupby("question_id").sample(frac=UNSEEN_ANSWER_SHARE, random_state=seed).sort_index()
    return {
        "train": seen.drop(unseen_answers.index),
        "unseen_answers": unseen_answers,
        "unseen_questions": data[held],
    }


def example_sheet(splits: dict[str, pd.DataFrame], seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(train, eval) for examples/grading: the EXAMPLE_QUESTIONS questions with the shortest answers among those
    not nearly all correct, as many rows of each; eval is unseen answers to the same questions."""
    train = splits["train"]
    by_question = train.groupby("question_id")
    correct = by_question.label.apply(lambda s: (s == "Correct").mean())
    lengths = by_question.student_answer.apply(lambda s: s.str.len().median())[correct <= EXAMPLE_MAX_CORRECT_SHARE]
    questions = sorted(lengths.nsmallest(EXAMPLE_QUESTIONS).index)

    def pick(frame: pd.DataFrame, total: int) -> pd.DataFrame:
        frame = frame[frame.question_id.isin(questions)].groupby("question_id")
        return frame.sample(n=total // len(questions), random_state=seed).sort_index()[EXAMPLE_COLUMNS]

    return pick(train, EXAMPLE_TRAIN_ROWS), pick(splits["unseen_answers"], EXAMPLE_EVAL_ROWS)


def write_examples(splits: dict[str, pd.DataFrame], folder: Path, seed: int = 0) -> None:
    """train.csv, eval.csv and answers.xlsx (a teacher's sheet to be graded: EXAMPLE_SHEET_ROWS rows of eval.csv
    without score, label or feedback, a Student column, and a "notes" sheet)."""
    train, evaluation = example_sheet(splits, seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, frame in (("train.csv", train), ("eval.csv", evaluation)):
        write_csv(frame, folder / name)
    turn = evaluation.groupby("question_id").cumcount()  # round robin over the questions, then back in file order
    sheet = evaluation.loc[turn.sort_values(kind="stable").index[:EXAMPLE_SHEET_ROWS]].sort_index()
    sheet = sheet.drop(columns=["score", "label", "feedback"])
    sheet.insert(0, "Student", [f"S{i:02d}" for i in range(1, len(sheet) + 1)])
    notes = pd.DataFrame({"notes": ["Answers to grade: write a score, a verdict (Correct / Partially correct / "
                                    "Incorrect) and feedback for each row. Slice of SAF v2.0 (English), "
                                    "MIT / CC BY 4.0; see LICENSE.md."]})
    with pd.ExcelWriter(folder / "answers.xlsx", engine="openpyxl") as book:
        sheet.to_excel(book, sheet_name="answers", index=False)
        notes.to_excel(book, sheet_name="notes", index=False, header=False)
    print(f"wrote {folder / 'answers.xlsx'} ({len(sheet)} rows + notes)")


def describe(splits: dict[str, pd.DataFrame]) -> str:
    total = sum(len(frame) for frame in splits.values())
    lines = [f"{'split':<18}{'rows':>6}{'share':>8}{'questions':>11}" + "".join(f"{label:>19}" for label in LABELS)]
    for name, frame in splits.items():
        counts = frame.label.value_counts()
        cells = "".join(f"{counts.get(label, 0):>10} ({counts.get(label, 0) / len(frame):5.1%})" for label in LABELS)
        lines.append(f"{name:<18}{len(frame):>6}{len(frame) / total:>8.1%}{frame.question_id.nunique():>11}{cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", type=Path, metavar="DIR", help="write the three splits as DIR/<split>.csv")
    parser.add_argument("--examples", type=Path, metavar="DIR", help="write the example sheet to DIR")
    args = parser.parse_args(argv)
    need_shared_data()
    splits = saf_split(seed=args.seed)
    print(f"unseen questions: {', '.join(sorted(splits['unseen_questions'].question_id.unique()))}")
    print(describe(splits))
    majority = splits["unseen_answers"].label.value_counts(normalize=True).iloc[0]
    print(f"majority-label share on unseen_answers: {majority:.1%}")
    if args.write:
        args.write.mkdir(parents=True, exist_ok=True)
        for name, frame in splits.items():
            write_csv(frame, args.write / f"{name}.csv")
    if args.examples:
        write_examples(splits, args.examples, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
