"""task: scoring end to end: a tiny scratch scorer learns a rule it can see (the verdict and score follow a word in
the student's answer) and grades held-out rows by it; check shows the heads' fields; a single label column's
final/ is a text-classification pipeline's model; generate --file with --with puts a scorer's verdict and score and
a generative grader's feedback in one sheet, every input column and row kept; serve answers with the fields;
export --gguf refuses it in one line."""

import csv
import json
import random

import pytest
from click.testing import CliRunner

from qatune.cli import cli
from tests.conftest import cli_ok
from tests.grading_runs import GRADING, copy_grading_run, read_csv

pytestmark = pytest.mark.slow

TOPICS = ["tcp", "udp", "routing", "dns", "ip", "arp", "ethernet", "wifi", "tls", "http"]
FILLER = ["because", "the", "packets", "header", "layer", "port", "flows", "window", "bytes", "clock"]


def rows(n, seed):
    """Answers whose verdict follows one word: 'right' -> Correct (1), 'unsure' -> Partly (0,5), 'wrong' ->
    Incorrect (0); the score has a decimal comma."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        word, verdict, score = [("right", "Correct", "1"), ("unsure", "Partly", "0,5"), ("wrong", "Incorrect", "0")][
            i % 3]
        words = rng.sample(FILLER, 5)
        words.insert(rng.randrange(6), word)
        out.append([f"what is {rng.choice(TOPICS)}?", " ".join(words), score, verdict])
    return out


def write(path, lines):
    with open(path, "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([["question", "student_answer", "score", "verdict"], *lines])
    return path


CONFIG = """
task: scoring
seed: 0
model:
  scratch: {{n_layer: 2, n_embd: 64, n_head: 4, vocab_size: 300, n_positions: 64}}  # learns the rule on seeds 0-5
data:
  train_file: {train}
  eval_file: {held}
  answer_columns: {columns}
  prompt_template: "Q: {{question}} A: {{student_answer}}"
train:
  epochs: 20
  batch_size: 8
  learning_rate: 1.0e-3
  warmup_steps: 0
  weight_decay: 0.0
  precision: fp32
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scoring")
    return write(folder / "train.csv", rows(90, 1)), write(folder / "held.csv", rows(30, 2))


def train(folder, data, columns, *sets):
    config = folder / "scoring.yaml"
    config.write_text(CONFIG.format(train=data[0], held=data[1], columns=columns), encoding="utf-8")
    overrides = [part for pair in sets for part in ("--set", pair)]
    cli_ok("train", "--config", config, "--output-dir", folder / "run", "--quiet", *overrides)
    return config, folder / "run"


@pytest.fixture(scope="module")
def scorer(tmp_path_factory, data):
    return train(tmp_path_factory.mktemp("scorer"), data, "[verdict, score]")


def test_a_scorer_learns_a_rule_it_can_see_and_grades_held_out_rows_by_it(scorer, data):
    _, run = scorer
    metrics = json.loads(cli_ok("eval", run, "--data", data[1], "--json").stdout)
    verdict, score = metrics["fields"]["verdict"], metrics["fields"]["score"]
    assert metrics["parse_rate"] == 100.0 and metrics["perplexity"] is None
    assert verdict["accuracy"] >= 90.0 and score["mae"] <= 0.1 and score["decimal"] == ","
    info = json.loads((run / "final" / "qatune.json").read_text())
    assert info["task"] == "scoring" and [h["name"] for h in info["scoring_heads"]] == ["verdict", "score"]
    saved = json.loads((run / "final" / "config.json").read_text())
    assert saved["architectures"] == ["BertForSequenceClassification"] and len(saved["id2label"]) == 4
    predictions = read_csv(run / "predictions-held.csv")
    assert predictions[0][6:] == ["parsed", "verdict (gold)", "verdict (predicted)", "score (gold)",
                                  "score (predicted)"]
    assert {row[8] for row in predictions[1:]} <= {"Correct", "Partly", "Incorrect"}
    assert {row[10] for row in predictions[1:]} <= {"0", "0,5", "1"}  # scores as training wrote them


def test_a_scorer_choosing_scores_among_values_with_balanced_classes_learns_the_rule_too(tmp_path, data):
    _, run = train(tmp_path, data, "[verdict, score]", "model.number_head=values",
                   "data.class_weights=balanced", "train.epochs=60")  # the toy needs longer without the ordered target
    heads = json.loads((run / "final" / "qatune.json").read_text())["scoring_heads"]
    assert [(h["name"], h["by_values"], h["width"]) for h in heads] == [("verdict", False, 3), ("score", True, 3)]
    assert heads[0]["class_weights"] == [1.0, 1.0, 1.0]  # 30 rows of each verdict: balanced is even
    metrics = json.loads(cli_ok("eval", run, "--data", data[1], "--json").stdout)
    verdict, score = metrics["fields"]["verdict"], metrics["fields"]["score"]
    assert verdict["accuracy"] >= 90.0 and score["mae"] <= 0.1 and score["exact"] >= 90.0


def test_check_shows_what_the_scorer_reads_and_its_heads(scorer):
    config, _ = scorer
    text = cli_ok("check", "--config", config).stdout
    assert "qatune check: scoring QA" in text and "What the model reads" in text
    assert "  verdict: label (inferred), 3 distinct values" in text
    assert "    read with a decimal comma (as in '0,5'); right within 0.125 of the gold value" in text
    assert "    head: a softmax over its 3 labels\n" in text
    assert "    head: one output on its training range, written as the nearest training value" in text
    text = cli_ok("check", "--config", config, "--set", "model.number_head=values", "--set",
                  "data.class_weights=sqrt").stdout
    assert ("    head: a softmax over its 3 labels: loss weights 'Correct' 1.00, 'Incorrect' 1.00, 'Partly' 1.00"
            in text)
    assert "    head: a softmax over its 3 training values, writing their median (model.number_head: values)" in text
    report = json.loads(cli_ok("check", "--config", config, "--json").stdout)
    assert report["fields"]["answer_tokens"] is None and report["lengths"]["max"] <= 64


def test_a_single_label_columns_final_folder_is_a_text_classification_pipelines_model(tmp_path, data):
    from transformers import pipeline

    _, run = train(tmp_path, data, "[verdict]")
    classify = pipeline("text-classification", model=str(run / "final"), device="cpu")
    held = rows(30, 2)
    texts = [f"Q: {question} A: {answer}" for question, answer, _, _ in held]
    said = [result["label"] for result in classify(texts)]
    assert set(said) <= {"Correct", "Partly", "Incorrect"}
    assert sum(label == row[3] for label, row in zip(said, held)) >= 27  # the rule, through transformers alone
    graded = cli_ok("generate", run, "--file", data[1], "--out", tmp_path / "graded.csv").stdout.strip()
    assert [row[4] for row in read_csv(graded)[1:]] == said  # qatune gives the pipeline's labels


def test_one_sheet_from_a_scorer_and_a_generative_grader(grading_run, tmp_path):
    from openpyxl import load_workbook

    _, grader = copy_grading_run(grading_run, tmp_path)
    scorer_config = tmp_path / "scorer.yaml"
    scorer_config.write_text(CONFIG.format(train=GRADING / "train.csv", held=GRADING / "eval.csv",
                                           columns="[label, score]").replace(
        'prompt_template: "Q: {question} A: {student_answer}"',
        'prompt_template: "{student_answer} {question}"').replace("n_positions: 64", "n_positions: 512")
        .replace("epochs: 20", "epochs: 1"), encoding="utf-8")
    cli_ok("train", "--config", scorer_config, "--output-dir", tmp_path / "scorer", "--quiet")
    out = tmp_path / "graded.xlsx"
    cli_ok("generate", tmp_path / "scorer", "--file", GRADING / "answers.xlsx", "--out", out, "--with", grader)
    given, graded = load_workbook(GRADING / "answers.xlsx"), load_workbook(out)
    before = [list(row) for row in given["answers"].iter_rows(values_only=True)]
    after = [list(row) for row in graded["answers"].iter_rows(values_only=True)]
    assert graded.sheetnames == given.sheetnames
    assert after[0] == [*before[0], "label", "score", "feedback", "parsed", "model output"]
    assert [row[: len(before[0])] for row in after] == before  # every input cell, row and column kept
    assert all(row[5] in ("Correct", "Partially correct", "Incorrect") for row in after[1:])  # the scorer's
    assert all(isinstance(row[6], int | float) for row in after[1:])
    # The generative grader's feedback, where its answer parsed whole. Asked from 'Feedback:' as training tokenizes an
    # answer ('Feedback', ':', 'ĠCorrect'), this one-layer grader writes ' Correct' and then, on 7 of the 10 rows, its
    # label's line again ('Correct\nFeedback: Correct.'), which does not parse. Asked after a lone space token, which
    # training never put there, it filled 9 cells, with noise such as 'Lood pointance.'. 3 cells here; 2 leaves a row
    # for another CPU's rounding.
    assert sum(bool(row[7]) for row in after[1:]) >= 2
    refused = CliRunner().invoke(cli, ["generate", str(tmp_path / "scorer"), "--file", str(GRADING / "answers.xlsx"),
                                       "--out", str(tmp_path / "again.xlsx"), "--with", str(tmp_path / "scorer")])
    assert refused.exit_code == 1
    assert "--with " in refused.stderr and "it gives no column the runs before it do not" in refused.stderr


def test_serve_answers_with_the_fields_and_export_refuses_a_scorer(scorer):
    pytest.importorskip("fastapi")
    from tests.unit.serve.test_app import serving

    _, run = scorer
    with serving(run) as client:
        body = client.post("/v1/answer", json={"question": "what is tcp?",
                                               "fields": {"student_answer": "the packets are right"}}).json()
        assert body["parsed"] is True and body["fields"]["verdict"] in ("Correct", "Partly", "Incorrect")
        assert body["answer"] == f"Verdict: {body['fields']['verdict']}\nScore: {body['fields']['score']}"
        assert client.get("/run").json()["kind"] == "scoring"
        # the scorer's heads answer through serve's batches as through qatune generate
        from qatune.kinds import answer_questions
        from qatune.model.folder import load_model_folder

        held = rows(6, 5)
        loaded = load_model_folder(run, device="cpu")
        expected = answer_questions(loaded.model, loaded.tokenizer, loaded.info, [r[0] for r in held], None,
                                    loaded.config.generate, fields=[{"student_answer": r[1]} for r in held])
        served = [client.post("/v1/answer", json={"question": r[0], "fields": {"student_answer": r[1]}}).json()
                  for r in held]
        assert [answer["answer"] for answer in served] == expected
    result = CliRunner().invoke(cli, ["export", str(run), "--gguf", str(run.parent / "x.gguf")])
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "scoring" in result.stderr and not (run.parent / "x.gguf").exists()
