"""Tiny generative runs whose prompts read more than the question (a {context}, a {score} column), trained
in seconds, for the tests of `qatune generate` and `qatune serve` on them."""

from __future__ import annotations

import csv
from pathlib import Path

from tests.conftest import TINY_MODEL

SCORE_TEMPLATE = "Q: {question}\nScore: {score}\nFeedback:"


def train_tiny(folder: Path, header: list[str], rows: list[list[str]], *overrides: str) -> Path:
    """Train a one-layer scratch model for 2 epochs on ``rows`` (written to folder/train.csv); returns the run."""
    from qatune.config import load_config
    from qatune.train import train

    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "train.csv"
    with open(data, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    config = load_config(None, [f"data.train_file={data}", *TINY_MODEL, "train.epochs=2", "train.batch_size=4",
                                *overrides])
    return train(config, output_dir=folder / "run", progress=False)


def score_run(folder: Path, *overrides: str) -> Path:
    """A run whose prompt names a column besides the question: ``Q: {question}\\nScore: {score}\\nFeedback:``."""
    rows = [[f"what is item {i}?", str(i % 3), f"thing {i}"] for i in range(8)]
    return train_tiny(folder, ["question", "score", "answer"], rows,
                      'data.prompt_template="Q: {question}\\nScore: {score}\\nFeedback:"', *overrides)


def context_run(folder: Path, *overrides: str) -> Path:
    """A generative run whose prompt reads a passage: ``Context: {context}\\nQuestion: {question}\\nAnswer:``."""
    rows = [[f"what is item {i}?", f"item {i} is thing {i}.", f"thing {i}"] for i in range(8)]
    return train_tiny(folder, ["question", "context", "answer"], rows, "data.context_column=context", *overrides)
