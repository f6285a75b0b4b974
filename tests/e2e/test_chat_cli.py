"""A chat model end to end through the CLI: a tiny Llama with SmolLM2's chat template (built from config,
tokenizer trained in the test) is checked, evaluated before training (--base), trained, evaluated and asked,
all with the same chat rendering. And a prompt that names several columns of a grading sheet."""

import csv
import json

import pytest
from openpyxl import Workbook

from tests.conftest import FIXTURES, chat_tokenizer, cli_ok, tiny_llama

pytestmark = pytest.mark.slow


def faq_rows(n):
    with open(FIXTURES / "faq100.csv", encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))[:n]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    rows = faq_rows(24)
    texts = [f"user assistant system {r['question']} {r['answer']}" for r in rows] * 3
    tokenizer = chat_tokenizer(texts, vocab_size=600)
    model = tiny_llama(tokenizer)
    folder = tmp_path_factory.mktemp("chat") / "tiny-llama-chat"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def config(chat_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cfg")
    data = tmp / "faq24.csv"
    with open(data, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "answer"])
        writer.writeheader()
        writer.writerows(faq_rows(24))
    path = tmp / "config.yaml"
    path.write_text(f"""
task: generative
output_dir: {tmp / "run"}
model: {{name_or_path: {chat_model}}}
data:
  train_file: {data}
  eval_file: {data}
  system_prompt: ""
train: {{epochs: 25, batch_size: 8, learning_rate: 1.0e-2, weight_decay: 0.0, warmup_steps: 5, logging_steps: 20}}
generate: {{max_new_tokens: 16}}
""", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def run_dir(config):
    result = cli_ok("train", "--config", config, "--quiet")
    return result.stdout.strip().splitlines()[-1]


def test_check_shows_the_chat_rendering_with_the_trained_tokens_marked(config):
    out = cli_ok("check", "--config", config).stdout
    rows = faq_rows(1)
    assert ("<|im_start|>system\n    <|im_end|>\n    <|im_start|>user\n    " + rows[0]["question"]
            + "<|im_end|>\n    <|im_start|>assistant\n    ⟦" + rows[0]["answer"] + "<|im_end|>⟧") in out
    assert "EOS supervised: yes ('<|im_end|>')" in out


def test_the_run_saves_the_rendered_chat_template_and_learns(run_dir):
    from pathlib import Path

    info = json.loads((Path(run_dir) / "final" / "qatune.json").read_text())
    assert info["prompt_template"] == ("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
                                       "<|im_start|>assistant\n")
    assert info["answer_prefix"] == ""
    config = json.loads((Path(run_dir) / "final" / "config.json").read_text())
    assert "quantization_config" not in config


def test_base_and_trained_evaluations_share_prompt_and_metrics(config, run_dir):
    base = json.loads(cli_ok("eval", "--base", "--config", config, "--json").stdout)
    trained = json.loads(cli_ok("eval", run_dir, "--data", base["data_file"], "--json").stdout)
    keys = {"exact_match", "f1", "loss", "perplexity", "num_examples"}
    assert keys <= set(base) and keys <= set(trained)
    assert base["num_examples"] == trained["num_examples"] == 24
    assert base["exact_match"] < 10 and trained["exact_match"] >= 75
    assert trained["loss"] < base["loss"] / 4


def test_generate_answers_a_learned_question(run_dir):
    row = faq_rows(3)[2]
    assert cli_ok("generate", run_dir, row["question"]).stdout.strip() == row["answer"]


GRADING_CONFIG = """
task: generative
output_dir: {out}
model:
  scratch: {{n_layer: 1, n_embd: 64, n_head: 2, vocab_size: 400, n_positions: 128}}
data:
  train_file: {sheet}
  question_column: Coding
  answer_column: Feedback
  prompt_template: "Marks: {{Total Marks}}\\nAnswer: {{Coding}}\\nFeedback:"
train: {{epochs: 40, batch_size: 4, learning_rate: 3.0e-3, weight_decay: 0.0, warmup_steps: 2}}
generate: {{max_new_tokens: 8}}
"""


def test_a_prompt_with_several_columns_trains_and_answers_files_and_fields(tmp_path):
    book = Workbook()
    sheet = book.active
    sheet.append(["Student ID", "Total Marks", "Coding", "Feedback"])
    for i, (marks, feedback) in enumerate([(3, "Well done."), (1, "Wrong loop."), (2, "Almost."), (0, "Missing.")]):
        sheet.append([100 + i, marks, "for i in range(10): print(i)", feedback])   # the same answer, other marks
    book.save(tmp_path / "marks.xlsx")
    config = tmp_path / "grading.yaml"
    config.write_text(GRADING_CONFIG.format(out=tmp_path / "run", sheet=tmp_path / "marks.xlsx"), encoding="utf-8")
    run = cli_ok("train", "--config", config, "--quiet").stdout.strip().splitlines()[-1]
    # Only the marks tell the rows apart: the model must read that column to answer.
    answers = cli_ok("generate", run, "--file", tmp_path / "marks.xlsx", "--output", tmp_path / "a.csv")
    with open(answers.stdout.strip(), encoding="utf-8", newline="") as f:
        got = [row["answer"] for row in csv.DictReader(f)]
    assert got == ["Well done.", "Wrong loop.", "Almost.", "Missing."]
    one = cli_ok("generate", run, "for i in range(10): print(i)", "--field", "total marks=1")
    assert one.stdout.strip() == "Wrong loop."

    from click.testing import CliRunner

    from qatune.cli import cli

    missing = CliRunner().invoke(cli, ["generate", run, "for i in range(10): print(i)"])
    assert missing.exit_code == 1
    assert missing.stderr.strip() == ("error: the run's prompt also needs the column(s) ['Total Marks']: pass each "
                                      "with --field 'NAME=VALUE', or answer a file that has them with --file")
