"""task: multiple-choice end to end: a tiny scratch GPT-2 learns which of four choices a question asks for (the one
about the question's topic, wherever it stands among them) and answers held-out questions with it; every answer is
one of the row's choices; an answer cell holding the choice's letter trains as the choice's text, one naming no
choice is dropped and counted; generate, eval and serve give the same answers."""

import csv
import json
import random

import pytest

from tests.conftest import cli_ok

pytestmark = pytest.mark.slow

TOPICS = ["tcp", "udp", "routing", "dns", "arp", "ethernet", "wifi", "tls", "http", "smtp"]
CHOICES = ["A", "B", "C", "D"]


def rows(n, seed):
    """Which choice is about the question's topic: its text, or (every third row) its letter."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        topics = rng.sample(TOPICS, 4)
        asked = rng.randrange(4)
        choices = [f"all about {topic}" for topic in topics]
        answer = CHOICES[asked] if i % 3 == 0 else choices[asked]
        out.append([f"which one is {topics[asked]}?", *choices, answer])
    return out


def write(path, lines):
    with open(path, "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([["question", *CHOICES, "answer"], *lines])
    return path


CONFIG = """
task: multiple-choice
seed: 0
model:
  scratch: {{n_layer: 2, n_embd: 64, n_head: 4, vocab_size: 300, n_positions: 96}}
data:
  train_file: {train}
  eval_file: {held}
  choice_columns: [A, B, C, D]
train:
  epochs: 30
  batch_size: 8
  learning_rate: 2.0e-3
  warmup_steps: 0
  weight_decay: 0.0
  precision: fp32
"""


@pytest.fixture(scope="module")
def exam(tmp_path_factory):
    folder = tmp_path_factory.mktemp("exam")
    unchosen = ["which one is dns?", "all about dns", "all about tcp", "all about udp", "all about arp", "all about ip"]
    train = [*rows(120, 1), unchosen]  # the last row's answer names none of its choices
    paths = write(folder / "train.csv", train), write(folder / "held.csv", rows(40, 2))
    config = folder / "exam.yaml"
    config.write_text(CONFIG.format(train=paths[0], held=paths[1]), encoding="utf-8")
    cli_ok("train", "--config", config, "--output-dir", folder / "run", "--quiet")
    return config, folder / "run", paths


def test_a_multiple_choice_run_answers_held_out_questions_with_one_of_their_choices(exam):
    _, run, (_, held) = exam
    metrics = json.loads(cli_ok("eval", run, "--data", held, "--json").stdout)
    assert metrics["num_examples"] == 40 and metrics["exact_match"] >= 90.0  # chance: 25
    with open(run / "predictions-held.csv", encoding="utf-8") as f:
        predictions = list(csv.reader(f))[1:]
    held_rows = rows(40, 2)
    # row (as the sheet numbers it), question, gold, prediction: each answer is one of its own row's choices
    assert all(p[3] in held_rows[int(p[0]) - 2][1:5] for p in predictions)
    info = json.loads((run / "final" / "qatune.json").read_text())
    assert info["task"] == "multiple-choice"
    assert info["prompt_template"] == "Question: {question}\nA. {A}\nB. {B}\nC. {C}\nD. {D}\nAnswer:"
    question, *choices, _ = held_rows[0]
    said = cli_ok("generate", run, question, *[part for name, text in zip(CHOICES, choices)
                                               for part in ("--field", f"{name}={text}")]).stdout.strip()
    assert said in choices
    answered = cli_ok("generate", run, "--file", held, "--out", run.parent / "answered.csv").stdout.strip()
    with open(answered, encoding="utf-8") as f:
        table = list(csv.reader(f))
    assert [row[-1] for row in table[1:]] == [p[3] for p in predictions]  # generate --file answers as eval does


def test_export_refuses_a_multiple_choice_run_in_one_line(exam):
    from click.testing import CliRunner

    from qatune.cli import cli

    _, run, _ = exam
    result = CliRunner().invoke(cli, ["export", str(run), "--gguf", str(run.parent / "x.gguf")])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "'A', 'B', 'C', 'D'" in result.stderr and not (run.parent / "x.gguf").exists()


def test_check_counts_the_row_whose_answer_is_no_choice_and_shows_the_choices_in_the_prompt(exam):
    config, _, _ = exam
    report = json.loads(cli_ok("check", "--config", config, "--json").stdout)
    assert report["task"] == "multiple-choice" and report["ok"]
    assert report["files"]["train_file"]["dropped"]["the answer is none of its choices"] == [122]
    codes = {f["code"]: f for f in report["findings"]}
    assert codes["answer-not-a-choice"]["level"] == "warning"
    text = cli_ok("check", "--config", config).stdout
    assert "A. all about" in text and "Answer:⟦ all about" in text  # the first row names its choice by letter


def test_serve_gives_the_answers_generate_gives(exam):
    pytest.importorskip("fastapi")
    from qatune.kinds import answer_questions
    from qatune.model.folder import load_model_folder
    from tests.unit.serve.test_app import serving

    _, run, _ = exam
    held = rows(6, 5)
    fields = [dict(zip(CHOICES, row[1:5])) for row in held]
    loaded = load_model_folder(run, device="cpu")
    expected = answer_questions(loaded.model, loaded.tokenizer, loaded.info, [r[0] for r in held], None,
                                loaded.config.generate, fields=fields)
    assert all(answer in row[1:5] for answer, row in zip(expected, held))
    with serving(run) as client:
        served = [client.post("/v1/answer", json={"question": r[0], "fields": f}).json()
                  for r, f in zip(held, fields)]
        assert [answer["answer"] for answer in served] == expected
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": held[0][0]}],
                                                         "fields": fields[0]}).json()
        assert chat["choices"][0]["message"]["content"] == expected[0]
