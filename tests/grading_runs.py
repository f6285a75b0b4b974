"""The grading run the end-to-end grading tests share: a tiny scratch GPT-2 trained on examples/grading to write a
tutor's score, verdict and feedback (data.answer_columns), trained once per session (tests/conftest.py's
grading_run; each module works on its own copy, since eval writes its results into the run)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

from tests.conftest import ROOT, cli_ok

GRADING = ROOT / "examples" / "grading"
CONFIG = f"""
task: generative
seed: 42
model:
  scratch: {{n_layer: 1, n_embd: 128, n_head: 2, vocab_size: 1000, n_positions: 1024}}
data:
  train_file: {GRADING / "train.csv"}
  eval_file: {GRADING / "eval.csv"}
  answer_columns: [score, label, feedback]
  prompt_template: "Question: {{question}}\\nReference: {{reference_answer}}\\nStudent: {{student_answer}}\\nGrade:"
train:
  epochs: 8
  batch_size: 16
  learning_rate: 5.0e-3
  warmup_steps: 10
  weight_decay: 0.0
  precision: fp32
generate:
  max_new_tokens: 64
"""


def read_csv(path: Path) -> list[list[str]]:
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.reader(f))


def train_grading_run(folder: Path) -> Path:
    """CONFIG written to FOLDER/grading.yaml and trained into FOLDER/run."""
    config = folder / "grading.yaml"
    config.write_text(CONFIG, encoding="utf-8")
    cli_ok("train", "--config", config, "--output-dir", folder / "run", "--quiet")
    return folder / "run"


def copy_grading_run(trained: Path, folder: Path) -> tuple[Path, Path]:
    """A copy of a trained grading run (and its config) in FOLDER: (config, run)."""
    shutil.copy(trained.parent / "grading.yaml", folder / "grading.yaml")
    shutil.copytree(trained, folder / "run")
    return folder / "grading.yaml", folder / "run"
