"""Seq2seq generative QA (the source question's advice: 'use a generative model such as T5'): a tiny T5
built from config with a Unigram tokenizer trained on the data, through the same commands."""

import csv
import json

import pytest

from tests.conftest import FIXTURES
from tests.conftest import cli_ok as invoke

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("t5")
    with open(FIXTURES / "faq100.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))[:40]
    data = tmp / "faq40.csv"
    with open(data, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "answer"])
        writer.writeheader()
        writer.writerows(rows)
    config = tmp / "t5.yaml"
    config.write_text(f"""
model:
  scratch: {{architecture: t5, n_layer: 2, n_embd: 128, n_head: 4, vocab_size: 1000}}
data:
  train_file: {data}
train: {{epochs: 40, batch_size: 8, learning_rate: 3.0e-3, warmup_steps: 10}}
""", encoding="utf-8")
    invoke("train", "--config", config, "--output-dir", tmp / "run", "--quiet")
    return tmp / "run", data, rows


def test_t5_learns_the_answers(run_dir):
    run, data, rows = run_dir
    metrics = json.loads(invoke("eval", run, "--data", data, "--json").stdout)
    assert metrics["num_examples"] == 40 and metrics["exact_match"] >= 80
    assert json.loads((run / "final" / "qatune.json").read_text())["seq2seq"] is True
    answer = invoke("generate", run, rows[1]["question"]).stdout.strip()
    assert answer == rows[1]["answer"]


def test_loads_with_plain_transformers(run_dir):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    run, _, rows = run_dir
    model = AutoModelForSeq2SeqLM.from_pretrained(run / "final")
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    inputs = tokenizer(f"Question: {rows[1]['question']}\nAnswer:", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=16)
    assert tokenizer.decode(out[0], skip_special_tokens=True).strip() == rows[1]["answer"]


def test_check_shows_encoder_input_and_decoder_target(run_dir, tmp_path):
    _, data, _ = run_dir
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{scratch: {{architecture: t5}}}}\ndata: {{train_file: {data}}}\n")
    out = invoke("check", "--config", config).stdout
    assert "encoder: Question:" in out and "decoder: ⟦" in out and "</s>⟧" in out
    assert "EOS supervised: yes" in out
