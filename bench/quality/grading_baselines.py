"""The baselines a grader would try first, on the grading splits of grading_data.py.

Each baseline reads a train DataFrame and a test one and returns, per test row, {"score", "label", "feedback"}
(all strings, as a model would write them). Fields a baseline does not aim at come from the rows its verdict
stands for:

majority_label           train's most frequent label for every row; score and feedback: the mean score and
                         the most frequent feedback of train's rows with that label
question_majority_label  the same per question_id (unseen questions: majority_label)
question_mean_score      the mean train score of the question (unseen questions: the global mean); label and
                         feedback as question_majority_label
question_median_score    the same with the median score (the score that makes the least absolute error)
nearest_feedback         the score, label and feedback of the most similar train answer to the same question
                         by TF-IDF cosine (unseen questions: the most similar train answer to any question)

    python bench/quality/grading_baselines.py   # verdict accuracy, macro-F1, score MAE, feedback F1; writes nothing
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for workloads

import numpy as np
import pandas as pd
from grading_data import saf_split
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.metrics import f1_score
from workloads import need_shared_data

from qatune.inference.metrics import f1 as token_f1

Prediction = dict[str, str]


def score_text(score: float) -> str:
    return f"{round(score, 2):g}"


def verdict(rows: pd.DataFrame) -> Prediction:
    """The majority label of `rows`, with the mean score and the most frequent feedback of its rows."""
    label = rows.label.value_counts().index[0]
    chosen = rows[rows.label == label]
    feedback = chosen.feedback.value_counts().index[0]
    return {"score": score_text(chosen.score.mean()), "label": label, "feedback": feedback}


def majority_label(train: pd.DataFrame, test: pd.DataFrame) -> list[Prediction]:
    return [verdict(train)] * len(test)


def question_majority_label(train: pd.DataFrame, test: pd.DataFrame) -> list[Prediction]:
    per_question = {question: verdict(rows) for question, rows in train.groupby("question_id")}
    fallback = verdict(train)
    return [per_question.get(question, fallback) for question in test.question_id]


def question_mean_score(train: pd.DataFrame, test: pd.DataFrame) -> list[Prediction]:
    means = train.groupby("question_id").score.mean()
    overall = train.score.mean()
    return [{**prediction, "score": score_text(means.get(question, overall))}
            for prediction, question in zip(question_majority_label(train, test), test.question_id)]


def question_median_score(train: pd.DataFrame, test: pd.DataFrame) -> list[Prediction]:
    medians = train.groupby("question_id").score.median()
    overall = train.score.median()
    return [{**prediction, "score": score_text(medians.get(question, overall))}
            for prediction, question in zip(question_majority_label(train, test), test.question_id)]


def answer_similarity(train: pd.DataFrame, test: pd.DataFrame) -> np.ndarray:
    """TF-IDF cosine of each test answer to each train answer: (test rows, train rows)."""
    vectorizer = TfidfVectorizer(sublinear_tf=True).fit(train.student_answer)
    # rows are L2-normalised, so the dot product is the cosine
    return (vectorizer.transform(test.student_answer) @ vectorizer.transform(train.student_answer).T).toarray()


def nearest_feedback(train: pd.DataFrame, test: pd.DataFrame) -> list[Prediction]:
    similarity = answer_similarity(train, test)
    train_questions = train.question_id.to_numpy()
    predictions = []
    for i, question in enumerate(test.question_id):
        same = train_questions == question
        scores = similarity[i] if not same.any() else np.where(same, similarity[i], -1.0)
        nearest = train.iloc[int(scores.argmax())]
        predictions.append({"score": score_text(nearest.score), "label": nearest.label, "feedback": nearest.feedback})
    return predictions


def similar_graded(train: pd.DataFrame, test: pd.DataFrame, k: int, text_chars: int = 0) -> list[str]:
    """Per test row, the verdicts and scores of its k most similar train answers to the same question (TF-IDF
    cosine; a row of train itself is never its own neighbour), most similar first, as text a scorer can read:
    "Correct 1; Partially correct 0.5; ..." ("none" for a question train lacks). With text_chars, the nearest
    one's answer too, cut to that many characters."""
    similarity = answer_similarity(train, test)
    train_questions = train.question_id.to_numpy()
    test_ids = test.answer_id.to_numpy()
    train_ids = train.answer_id.to_numpy()
    out = []
    for i, question in enumerate(test.question_id):
        scores = np.where((train_questions == question) & (train_ids != test_ids[i]), similarity[i], -np.inf)
        order = [j for j in np.argsort(-scores, kind="stable")[:k] if np.isfinite(scores[j])]
        if not order:
            out.append("none")
            continue
        text = "; ".join(f"{train.label.iloc[j]} {score_text(train.score.iloc[j])}" for j in order)
        if text_chars:
            text += f"\nNearest graded answer: {train.student_answer.iloc[order[0]][:text_chars]}"
        out.append(text)
    return out


BASELINES = {
    "majority_label": majority_label,
    "question_majority_label": question_majority_label,
    "question_mean_score": question_mean_score,
    "question_median_score": question_median_score,
    "nearest_feedback": nearest_feedback,
}


def evaluate(predictions: list[Prediction], test: pd.DataFrame) -> dict[str, float]:
    """Verdict accuracy and macro-F1 over the labels in `test` (0-100), score MAE, feedback token F1 (0-100)."""
    labels = [p["label"] for p in predictions]
    return {
        "accuracy": 100.0 * float(np.mean([p == g for p, g in zip(labels, test.label)])),
        "macro_f1": 100.0 * f1_score(test.label, labels, labels=sorted(set(test.label)), average="macro",
                                     zero_division=0),
        "score_mae": float((test.score - [float(p["score"]) for p in predictions]).abs().mean()),
        "feedback_f1": 100.0 * sum(map(token_f1, (p["feedback"] for p in predictions), test.feedback)) / len(test),
    }


def main() -> int:
    need_shared_data()
    splits = saf_split()
    print(f"{'split':<18}{'baseline':<25}{'rows':>6}{'accuracy':>10}{'macro-F1':>10}{'score MAE':>11}"
          f"{'feedback F1':>13}")
    for split in ("unseen_answers", "unseen_questions"):
        test = splits[split]
        for name, baseline in BASELINES.items():
            m = evaluate(baseline(splits["train"], test), test)
            print(f"{split:<18}{name:<25}{len(test):>6}{m['accuracy']:>10.1f}{m['macro_f1']:>10.1f}"
                  f"{m['score_mae']:>11.3f}{m['feedback_f1']:>13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
