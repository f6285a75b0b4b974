"""A real `qatune train` process stopped from outside: SIGKILL at any moment leaves only loadable
checkpoints; SIGTERM saves one, and `qatune train --resume` continues from it."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from qatune.cli import cli
from qatune.train.checkpoint import find_checkpoint, list_checkpoints

pytestmark = pytest.mark.slow

ROWS = [(f"question number {i}", f"answer {i % 5}") for i in range(12)]


def write_data(tmp_path):
    data = tmp_path / "qa.csv"
    data.write_text("question,answer\n" + "".join(f"{q},{a}\n" for q, a in ROWS), encoding="utf-8")
    return data


SLOW_CONFIG = """
model: {{scratch: {{n_layer: 2, n_embd: 64, n_head: 2, vocab_size: 300}}}}
data: {{train_file: {data}}}
train: {{epochs: 200, batch_size: 2, save_every: 1, keep_checkpoints: 3, learning_rate: 1.0e-3}}
"""


def start_training(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(SLOW_CONFIG.format(data=write_data(tmp_path)), encoding="utf-8")
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "qatune", "train", "--config", str(config), "--output-dir",
                             str(run), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while len(list_checkpoints(run)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    return proc, config, run


@pytest.mark.slow
def test_sigkill_at_any_moment_leaves_only_loadable_checkpoints(tmp_path):
    proc, _, run = start_training(tmp_path)
    time.sleep(0.7)
    proc.kill()
    proc.wait()
    checkpoints = list_checkpoints(run)
    assert checkpoints
    for checkpoint in checkpoints:
        json.loads((checkpoint / "trainer_state.json").read_text())
        load_file(checkpoint / "model.safetensors")
        torch.load(checkpoint / "optimizer.pt", weights_only=True)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_cli_resumes(tmp_path):
    proc, config, run = start_training(tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "training stopped by SIGTERM" in stderr and "--resume" in stderr
    assert "Traceback" not in stderr
    stopped = json.loads((find_checkpoint(run) / "trainer_state.json").read_text())
    assert json.loads((run / "run.json").read_text())["status"] == "stopped"
    # Resume and train to the end of the epoch after the one it stopped in: 12 rows / batch 2 = 6 steps each.
    epochs = stopped["epoch"] + 2
    result = CliRunner().invoke(cli, ["train", "--config", str(config), "--output-dir", str(run), "--resume",
                                      "--set", f"train.epochs={epochs}", "--quiet"])
    assert result.exit_code == 0, result.output + result.stderr
    assert json.loads((run / "run.json").read_text())["status"] == "complete"
    final = json.loads((find_checkpoint(run) / "trainer_state.json").read_text())
    assert (final["step"], final["epoch"]) == (6 * epochs, epochs)
    assert final["step"] > stopped["step"]
