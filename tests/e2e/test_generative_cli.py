"""The seed's scenario end to end through the CLI: a tiny GPT-2 learns 100 FAQ-like rows by heart.

40 epochs, not 30: under bf16 (what ``precision: auto`` picks on a CPU with AVX512-BF16) 30 epochs left an
AMD EPYC at 89% exact match, one row short of the test's 90; 40 reach 99% there."""

import csv
import json

import pytest

from tests.conftest import FIXTURES
from tests.conftest import cli_ok as invoke

pytestmark = pytest.mark.slow

CONFIG = f"""
task: generative
seed: 42
model:
  scratch: {{n_layer: 2, n_embd: 256, n_head: 4, vocab_size: 2000, n_positions: 128}}
data:
  train_file: {FIXTURES / "faq100.csv"}
train:
  epochs: 40
  batch_size: 10
  learning_rate: 1.0e-3
  weight_decay: 0.0
  warmup_steps: 10
  logging_steps: 5
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    config = tmp / "config.yaml"
    config.write_text(CONFIG, encoding="utf-8")
    result = invoke("train", "--config", config, "--output-dir", tmp / "run", "--quiet")
    assert result.stdout.strip() == str(tmp / "run")
    return tmp / "run"


def test_run_directory_is_complete(run_dir):
    for name in ["config.yaml", "run.json", "metrics.jsonl", "final/model.safetensors", "final/config.json",
                 "final/tokenizer.json", "final/qatune.json", "final/config.yaml"]:
        assert (run_dir / name).is_file(), name
    assert not list(run_dir.glob("final/*.bin"))
    status = json.loads((run_dir / "run.json").read_text())
    assert status["status"] == "complete"
    info = json.loads((run_dir / "final/qatune.json").read_text())
    assert info["prompt_template"] == "Question: {question}\nAnswer:" and info["task"] == "generative"


def test_loss_falls(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if line["event"] == "train"]
    assert train[0]["step"] == 1 and train[-1]["step"] == 400
    assert {"step", "epoch", "loss", "lr", "grad_norm", "supervised_tokens", "tokens_per_s"} <= set(train[0])
    assert train[-1]["loss"] < train[0]["loss"] / 10


@pytest.fixture(scope="module")
def evaluated(run_dir):
    """`qatune eval` of the run on its own training rows: the metrics it prints (it also writes
    predictions-faq100.csv into the run)."""
    return json.loads(invoke("eval", run_dir, "--data", FIXTURES / "faq100.csv", "--json").stdout)


def test_eval_learns_the_questions(run_dir, evaluated):
    metrics = evaluated
    assert set(metrics) >= {"exact_match", "f1", "loss", "perplexity", "num_examples"}
    assert metrics["num_examples"] == 100
    assert metrics["exact_match"] >= 90
    assert metrics["f1"] >= metrics["exact_match"]
    with open(run_dir / "predictions-faq100.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["row", "question", "gold", "prediction", "em", "f1"]
    assert sum(float(r["em"]) for r in rows) / len(rows) == pytest.approx(metrics["exact_match"])
    assert json.loads((run_dir / "eval-faq100.json").read_text())["exact_match"] == metrics["exact_match"]


def test_generate_returns_the_trained_answer(run_dir, evaluated):
    with open(FIXTURES / "faq100.csv", encoding="utf-8") as f:
        gold = {row["question"]: row["answer"] for row in csv.DictReader(f)}
    with open(run_dir / "predictions-faq100.csv", encoding="utf-8") as f:
        right = [row for row in csv.DictReader(f) if row["em"] == "100"][:3]
    assert len(right) == 3, f"eval got {evaluated['exact_match']}% exact: too few rows right to ask about"
    for row in right:
        assert invoke("generate", run_dir, row["question"]).stdout == gold[row["question"]] + "\n"


def test_generate_a_file_of_questions(run_dir, tmp_path):
    questions = tmp_path / "ask.csv"
    questions.write_text("question\nwhere did henry knox die?\n", encoding="utf-8")
    out = tmp_path / "answers.csv"
    invoke("generate", run_dir, "--file", questions, "--output", out)
    with open(out, encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [r["question"] for r in rows] == ["where did henry knox die?"]
    assert rows[0]["answer"] == "Thomaston"


def test_final_model_loads_with_plain_transformers(run_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    prompt = tokenizer("Question: where did henry knox die?\nAnswer:", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.strip() == "Thomaston"
