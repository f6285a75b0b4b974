"""Extractive QA end to end through the CLI: a tiny BERT trained on a real XQuAD slice."""

import csv
import json

import pytest
from click.testing import CliRunner

from qatune.cli import cli
from tests.conftest import FIXTURES
from tests.conftest import cli_ok as invoke

pytestmark = pytest.mark.slow

DATA = FIXTURES / "xquad_slice.csv"
CONFIG = f"""
task: extractive
seed: 42
model:
  scratch: {{n_layer: 2, n_embd: 128, n_head: 4, vocab_size: 3000, n_positions: 256}}
data:
  train_file: {DATA}
  question_column: question
  context_column: context
  answer_column: answer
  max_length: 128
  doc_stride: 32
train:
  epochs: 10
  batch_size: 16
  learning_rate: 1.0e-3
  logging_steps: 5
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ext")
    config = tmp / "config.yaml"
    config.write_text(CONFIG, encoding="utf-8")
    invoke("train", "--config", config, "--output-dir", tmp / "run", "--quiet")
    return tmp / "run"


def test_run_is_complete_with_span_audit(run_dir):
    status = json.loads((run_dir / "run.json").read_text())
    assert status["status"] == "complete"
    encoding = status["data"]["encoding"]
    assert encoding["windows"] > 60 and encoding["windows_without_answer"] > 0
    # the slice has no answer_start column: every answer was found in its context
    assert encoding["answer_not_in_context_rows"] == []
    assert encoding["span_audit"]["share"] >= 0.95
    for name in ["final/model.safetensors", "final/tokenizer.json", "final/qatune.json", "metrics.jsonl"]:
        assert (run_dir / name).is_file()


def test_loss_falls(run_dir):
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert train[-1]["loss"] < train[0]["loss"] / 3


@pytest.fixture(scope="module")
def evaluated(run_dir):
    """`qatune eval` of the run on its training rows: the metrics it prints, and the rows of the
    predictions-xquad_slice.csv it writes into the run."""
    metrics = json.loads(invoke("eval", run_dir, "--data", DATA, "--json").stdout)
    with open(run_dir / "predictions-xquad_slice.csv", encoding="utf-8") as f:
        return metrics, list(csv.DictReader(f))


def test_eval_metrics_and_predictions(run_dir, evaluated):
    metrics, _ = evaluated
    assert metrics["num_examples"] == 60 and metrics["perplexity"] is None
    first_train_loss = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert 0 < metrics["loss"] < first_train_loss / 2   # the training rows: far below the untrained loss
    assert metrics["f1"] >= 30       # an untrained model scores about 3
    with open(run_dir / "predictions-xquad_slice.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 60


def test_generate_returns_a_span_of_the_context(run_dir, evaluated):
    _, predictions = evaluated
    with open(DATA, encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    row = rows[0]
    answer = invoke("generate", run_dir, row["question"], "--context", row["context"]).stdout.rstrip("\n")
    assert answer and answer in row["context"]
    assert answer == predictions[0]["prediction"]        # what eval predicted for the same row
    learned = [(row, p) for row, p in zip(rows, predictions, strict=True) if p["em"] == "100"]
    assert learned, "eval got no row exactly right"
    row, _ = learned[0]
    assert invoke("generate", run_dir, row["question"], "--context", row["context"]).stdout == row["answer"] + "\n"


def test_generate_with_context_file_and_file(run_dir, evaluated, tmp_path):
    _, predictions = evaluated
    passage = tmp_path / "passage.txt"
    passage.write_text("The Saxon Garden was opened to the public in 1727.", encoding="utf-8")
    answer = invoke("generate", run_dir, "When was it opened?", "--context-file", passage).stdout.strip()
    assert answer and answer in passage.read_text()
    assert answer == invoke("generate", run_dir, "When was it opened?", "--context", passage.read_text()).stdout.strip()
    out = tmp_path / "answers.csv"
    invoke("generate", run_dir, "--file", DATA, "--output", out)
    with open(out, encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 60 and all(r["answer"] for r in rows)
    assert [r["answer"] for r in rows] == [p["prediction"] for p in predictions]   # a file's answers are eval's


def test_generate_without_context_is_a_clear_error(run_dir):
    result = CliRunner().invoke(cli, ["generate", str(run_dir), "Who?"])
    assert result.exit_code == 1
    assert "pass the passage with --context" in result.stderr


def test_final_model_loads_with_plain_transformers(run_dir):
    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    model = AutoModelForQuestionAnswering.from_pretrained(run_dir / "final")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    inputs = tokenizer("who?", "a passage", return_tensors="pt")
    assert "token_type_ids" in inputs
    out = model(**inputs)
    assert out.start_logits.shape == out.end_logits.shape == inputs["input_ids"].shape
