"""qatune check through the CLI: readable report, JSON, exit codes."""

import json

import pytest
from click.testing import CliRunner

from qatune.cli import cli
from qatune.train.memory_estimate import processes_here


def write_config(tmp_path, rows, extra=""):
    data = tmp_path / "qa.csv"
    data.write_text("question,answer\n" + "".join(f"{q},{a}\n" for q, a in rows), encoding="utf-8")
    config = tmp_path / "c.yaml"
    config.write_text(f"""
model:
  scratch: {{n_layer: 1, n_embd: 64, n_head: 2, vocab_size: 400}}
data:
  train_file: {data}
train:
  batch_size: 4
  learning_rate: 3.0e-3
{extra}""", encoding="utf-8")
    return config


ROWS = [(f"what is item {i}?", f"thing {i}") for i in range(20)]


def test_report_shows_what_is_trained_and_exits_0(tmp_path):
    result = CliRunner().invoke(cli, ["check", "--config", str(write_config(tmp_path, ROWS))])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "20 rows read, 20 kept" in out
    assert "EOS supervised: yes" in out
    assert ("  validation: none (no validation loss, no best/ model, no early stopping; set data.eval_file or "
            "data.validation_fraction)") in out.splitlines()
    split = CliRunner().invoke(cli, ["check", "--config", str(write_config(tmp_path, ROWS)), "--set",
                                     "data.validation_fraction=0.2"])
    assert ("  validation: 4 rows held out of the training file (data.validation_fraction=0.2; the same question "
            "never on both sides)") in split.stdout.splitlines()
    assert "    Question: what is item 0?\n    Answer:⟦ thing 0<|endoftext|>⟧" in out
    assert out.rstrip().endswith("fit to train")


def test_json_report_and_warnings_keep_exit_0(tmp_path):
    config = write_config(tmp_path, ROWS[:2])        # the seed's two-row sheet
    result = CliRunner().invoke(cli, ["check", "--config", str(config), "--json"])
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["ok"] is True
    codes = {f["code"] for f in report["findings"]}
    assert {"tiny-dataset", "batch-larger-than-dataset", "no-validation"} <= codes
    assert report["supervision"]["eos_supervised"] is True
    assert report["lengths"]["max"] == report["max_length"]
    time = report["training_time"]  # the estimate: an epoch's batches and validation at a rate timed here
    assert time["seconds"] == pytest.approx(3 * (time["epoch_seconds"] + time["validation_seconds"]), abs=0.2)
    assert time["seconds"] > 0 and "3 epochs" in time["basis"] and "matrix product timed on this CPU" in time["basis"]
    runnable = {s["setup"]: s["runnable"] for s in report["memory"]["setups"]}
    assert runnable["1 process"] is True
    assert runnable["ddp x 2"] is (processes_here() >= 2)  # one process per two cores, or per GPU


def test_the_report_says_about_how_long_training_takes(tmp_path):
    result = CliRunner().invoke(cli, ["check", "--config", str(write_config(tmp_path, ROWS))])
    lines = result.stdout.splitlines()
    time = lines[lines.index("Time") + 1]
    assert time.startswith("  training: about ") and " on this machine (" in time and "3 epochs" in time


def test_overfit_passes_when_wired_and_fails_when_it_cannot_learn(tmp_path):
    config = write_config(tmp_path, ROWS)
    result = CliRunner().invoke(cli, ["check", "--config", str(config), "--overfit", "4", "--json"])
    assert result.exit_code == 0, result.output
    overfit = json.loads(result.stdout)["overfit"]
    assert overfit["passed"] and overfit["final_loss"] < overfit["first_loss"] / 20
    result = CliRunner().invoke(cli, ["check", "--config", str(config), "--overfit", "4",
                                      "--set", "train.learning_rate=1e-7"])
    assert result.exit_code == 1
    assert "error: [overfit-failed]" in result.stdout and "did not fall near zero" in result.stdout


def test_leakage_between_train_and_eval_is_reported(tmp_path):
    held = tmp_path / "held.csv"
    held.write_text("question,answer\nWhat is item 3?,thing 3\nnew question?,x\n", encoding="utf-8")
    config = write_config(tmp_path, ROWS, extra="  epochs: 1\n")
    result = CliRunner().invoke(cli, ["check", "--config", str(config), "--set", f"data.eval_file={held}", "--json"])
    report = json.loads(result.stdout)
    assert report["leakage"] == {"count": 1, "examples": ["What is item 3?"]}
    assert "leakage" in {f["code"] for f in report["findings"]}
    assert report["files"]["validation"] == {"rows": 2, "fraction": 0.0, "file": "held.csv"}


def test_check_on_bad_data_is_one_error_line(tmp_path):
    config = write_config(tmp_path, ROWS)
    result = CliRunner().invoke(cli, ["check", "--config", str(config), "--set", "data.answer_column=reply"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: column 'reply' not found in qa.csv; columns are ['question', 'answer']")


def test_check_refuses_settings_this_machine_cannot_train_with(tmp_path):
    config = write_config(tmp_path, ROWS)
    result = CliRunner().invoke(cli, ["check", "--config", str(config), "--set", "train.device=cpu",
                                      "--set", "train.precision=fp16"])
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: train.precision fp16 needs a GPU; on CPU use bf16 or fp32"
    result = CliRunner().invoke(cli, ["check", "--config", str(config), "--json", "--set", "train.device=cpu",
                                      "--set", "train.precision=fp16"])
    assert result.exit_code == 1
    assert json.loads(result.stdout) == {"ok": False,
                                         "error": "train.precision fp16 needs a GPU; on CPU use bf16 or fp32"}
