"""`qatune train --resume` as a user meets it: the command the stop message prints, the run's own saved
config, and a config file that would end a stopped run early."""

import json
import shlex

import pytest
import yaml
from click.testing import CliRunner

from qatune.cli import cli
from tests.conftest import interrupt_at, tiny_config

ROWS = [(f"question number {i}", f"answer {i % 5}") for i in range(12)]


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def last_line(result):
    return result.stderr.strip().splitlines()[-1]


@pytest.fixture
def config_file(tmp_path):
    """A config file that says 1 epoch: 12 rows, batch 2, accumulation 2 make 3 steps per epoch."""
    config = tiny_config(tmp_path, ROWS, "train.epochs=1", "train.batch_size=2", "train.gradient_accumulation_steps=2",
                         "train.save_every=2", "train.learning_rate=3e-3", "train.device=cpu")
    path = tmp_path / "c.yaml"
    path.write_text(config.to_yaml(), encoding="utf-8")
    return path


def train_lines(run):
    """Every training-loss line, its measured fields left out (speed; the peak memory of this test process, which
    other tests in it raise)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in ("tokens_per_s", "peak_memory_mb", "rss_mb")} for line in lines
            if line["event"] == "train"]


def saved_epochs(run):
    return yaml.safe_load((run / "config.yaml").read_text())["train"]["epochs"]


def status(run):
    return json.loads((run / "run.json").read_text())


@pytest.mark.slow
def test_a_run_longer_than_its_config_file_is_not_ended_by_it_and_resumes_with_the_printed_command(
        tmp_path, config_file, monkeypatch):
    straight = tmp_path / "straight"
    result = invoke("train", "--config", config_file, "--set", "train.epochs=3", "--output-dir", straight, "--quiet")
    assert result.exit_code == 0, result.output + result.stderr
    run = tmp_path / "run"
    interrupt_at(monkeypatch, 4)                                          # in epoch 2 of 3
    stopped = invoke("train", "--config", config_file, "--set", "train.epochs=3", "--output-dir", run, "--quiet")
    monkeypatch.undo()
    assert stopped.exit_code == 130, stopped.output + stopped.stderr
    message = last_line(stopped)
    assert "training stopped by SIGINT at step 4 (in epoch 2)" in message
    assert message.endswith(f"; resume with: qatune train --resume {run}")   # no placeholder to fill in

    # The config file says 1 epoch: it used to end the run after 4 of its 9 steps and mark it complete.
    refused = invoke("train", "--config", config_file, "--resume", run, "--quiet")
    assert refused.exit_code == 1, refused.output + refused.stderr
    assert "Traceback" not in refused.stderr
    assert last_line(refused).startswith(f"error: the run stopped in epoch 2 of 3 (step 4, "
                                         f"{run / 'checkpoints' / 'step-0000004'}); train.epochs 1 would end it")
    assert f"(qatune train --resume {run})" in last_line(refused)
    assert "--set train.epochs to 2 or more" in last_line(refused)
    assert status(run)["status"] == "stopped" and saved_epochs(run) == 3     # nothing touched

    command = shlex.split(message.split("resume with: ")[1])
    assert command[:2] == ["qatune", "train"]
    resumed = invoke(*command[1:], "--quiet")
    assert resumed.exit_code == 0, resumed.output + resumed.stderr
    assert "(step 4, epoch 2 of 3)" in resumed.stderr
    assert status(run)["status"] == "complete" and status(run)["result"]["steps"] == 9
    assert saved_epochs(run) == 3
    assert train_lines(run) == train_lines(straight)


@pytest.mark.slow
def test_resume_without_config_takes_set_of_the_resumable_keys_only(tmp_path, config_file, monkeypatch):
    run = tmp_path / "run"
    interrupt_at(monkeypatch, 2)
    assert invoke("train", "--config", config_file, "--output-dir", run, "--quiet").exit_code == 130
    monkeypatch.undo()
    refused = invoke("train", "--resume", run, "--set", "train.learning_rate=1e-4", "--quiet")
    assert refused.exit_code == 1
    assert "differs from the run being resumed in ['train.learning_rate']; only train.epochs" in last_line(refused)
    assert status(run)["status"] == "stopped"

    longer = invoke("train", "--resume", run, "--set", "train.epochs=2", "--quiet")
    assert longer.exit_code == 0, longer.output + longer.stderr
    assert status(run)["result"]["steps"] == 6 and saved_epochs(run) == 2
    # --resume with no path: the run of --output-dir, with its own config (now 2 epochs) and one more
    again = invoke("train", "--output-dir", run, "--resume", "--set", "train.epochs=3", "--quiet")
    assert again.exit_code == 0, again.output + again.stderr
    assert status(run)["result"]["steps"] == 9 and saved_epochs(run) == 3


def test_train_without_config_says_what_to_pass(tmp_path):
    missing = invoke("train")
    assert missing.exit_code == 2
    assert "Error: Missing option '--config' (or --resume RUN_DIR to continue a stopped run)." in missing.stderr
    no_run = invoke("train", "--resume")
    assert no_run.exit_code == 2 and "--resume without --config needs the run to continue" in no_run.stderr
    nothing = invoke("train", "--resume", tmp_path / "nothing")
    assert nothing.exit_code == 1
    assert last_line(nothing) == (f"error: nothing to resume in {tmp_path / 'nothing'}: "
                                  f"{tmp_path / 'nothing' / 'config.yaml'} not found; pass a run directory written "
                                  "by qatune train (or one of its checkpoints)")
