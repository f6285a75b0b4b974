"""The memory estimate of qatune check: its parts from the model's shapes, the set-ups it compares, the warning
with the cheapest change that fits, and the estimate against a training process's measured peak."""

import json
import subprocess
import sys

import pytest

from qatune.commands.check import run_check
from qatune.train import memory_estimate
from tests.conftest import ROOT, tiny_config

ROWS = [(f"what is item {i}?", f"thing {i}") for i in range(20)]


def test_parts_follow_the_model(tmp_path):
    config = tiny_config(tmp_path, ROWS, "model.scratch.n_layer=2")
    from qatune.train import prepare

    prepared = prepare(config, with_model=False)
    model = memory_estimate.meta_model(config, prepared.tokenizer, False)
    assert all(p.device.type == "meta" for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    one, ddp, fsdp = memory_estimate.estimate(model, config, "fp32", (4, 30), 5, processes=2, baseline=0)
    assert one.parts["weights"] == 4 * params and one.parts["gradients"] == 4 * params
    assert one.parts["optimizer"] == 8 * params
    assert ddp.parts["ddp buckets"] == 4 * params and ddp.total == one.total + 4 * params
    assert fsdp.parts["weights"] == 4 * params // 2 and fsdp.parts["optimizer"] == 8 * params // 2
    # activations: 2 layers x 4 rows x 30 tokens x (34 x 32 + 5 x 2 heads x 30) 16-bit values, twice in fp32
    assert one.parts["activations"] == 2 * 4 * 30 * (34 * 32 + 5 * 2 * 30) * 2
    # activation checkpointing: each block's input (2 layers x 4 x 30 x 32 values) and one block recomputed
    checkpointed = tiny_config(tmp_path, ROWS, "model.scratch.n_layer=2", "train.activation_checkpointing=true")
    kept = memory_estimate.estimate(model, checkpointed, "fp32", (4, 30), 5, processes=1, baseline=0)[0]
    assert kept.parts["activations"] == 2 * 4 * 30 * 32 * 2 * 2 + 4 * 30 * (34 * 32 + 5 * 2 * 30) * 2
    lora = tiny_config(tmp_path, ROWS, "model.scratch.n_layer=2", "model.lora.r=4")
    adapters = memory_estimate.meta_model(lora, prepared.tokenizer, False)
    with_lora = memory_estimate.estimate(adapters, lora, "fp32", (4, 30), 5, processes=1, baseline=0)[0]
    assert with_lora.parts["optimizer"] < one.parts["optimizer"] / 5  # only the adapters are trained


def test_a_setup_that_does_not_fit_is_a_warning_with_the_cheapest_change(tmp_path, monkeypatch):
    config = tiny_config(tmp_path, ROWS, "train.batch_size=8")
    monkeypatch.setattr("qatune.commands.check.resident_bytes", lambda: 0)  # the model's own needs alone
    needed = run_check(config)["memory"]["setups"][0]["needed_bytes"]
    half = run_check(tiny_config(tmp_path, ROWS, "train.batch_size=4"))["memory"]["setups"][0]["needed_bytes"]
    assert half < needed
    # A device between the two: the batch of 8 does not fit, half of it does.
    monkeypatch.setattr("qatune.commands.check.available_bytes", lambda: (int((needed + half) / 2 / 0.9),
                                                                          "RAM available"))
    report = run_check(config)
    warning = next(f for f in report["findings"] if f["code"] == "memory")
    assert warning["level"] == "warning" and report["ok"]
    assert warning["message"].startswith(f"the 1 process set-up needs an estimated {needed / 2**30:.1f} GiB")
    assert warning["message"].endswith("; train.batch_size 4 with train.gradient_accumulation_steps 2 (the same "
                                       "updates) fits")
    assert not report["memory"]["setups"][0]["fits"]


def test_processes_judge_a_ddp_config_by_its_ddp_row_sharing_the_ram(tmp_path, monkeypatch):
    config = tiny_config(tmp_path, ROWS, "train.batch_size=8")
    monkeypatch.setattr("qatune.commands.check.resident_bytes", lambda: 0)  # the model's own needs alone
    one, ddp = run_check(config, processes=4)["memory"]["setups"][:2]
    assert (one["setup"], ddp["setup"]) == ("1 process", "ddp x 4")
    per_process = ddp["needed_bytes"] // 4  # four processes on one machine's RAM
    assert one["needed_bytes"] < per_process  # DDP's reduction buckets
    # RAM for two one-process runs: one process fits, the four DDP processes do not.
    monkeypatch.setattr("qatune.commands.check.available_bytes", lambda: (int(2 * per_process / 0.9), "RAM available"))
    report = run_check(config, processes=4)
    assert report["memory"]["configured"] == "ddp x 4" and report["memory"]["setups"][0]["fits"]
    warning = next(f for f in report["findings"] if f["code"] == "memory")
    assert warning["message"].startswith(f"the ddp x 4 set-up needs an estimated {4 * per_process / 2**30:.1f} GiB "
                                         f"(4 processes of {per_process / 2**30:.1f} GiB each) and the device has")
    # Without --processes the run trains as one process, which fits.
    alone = run_check(config)
    assert alone["memory"]["configured"] == "1 process" and not any(f["code"] == "memory" for f in alone["findings"])
    # A GPU each: a process needs its own share only.
    monkeypatch.setattr("qatune.commands.check.available_bytes", lambda: (int(1.1 * per_process / 0.9), "GPU x"))
    assert run_check(config, processes=4)["memory"]["setups"][1]["fits"]


@pytest.mark.slow
def test_estimate_is_within_30_percent_of_the_measured_peak(tmp_path):
    config = tmp_path / "c.yaml"
    (tmp_path / "qa.csv").write_text("question,answer\n" + "".join(f"{q},{a}\n" for q, a in ROWS))
    config.write_text(f"model: {{scratch: {{n_layer: 2, n_embd: 64, n_head: 2, vocab_size: 300}}}}\n"
                      f"data: {{train_file: {tmp_path / 'qa.csv'}}}\ntrain: {{epochs: 2, batch_size: 4}}\n")
    check = subprocess.run([sys.executable, "-m", "qatune", "check", "--config", str(config), "--json"],
                           capture_output=True, text=True, cwd=ROOT, check=True)
    estimated = json.loads(check.stdout)["memory"]["setups"][0]["total_gib"]
    subprocess.run([sys.executable, "-m", "qatune", "train", "--config", str(config), "--output-dir",
                    str(tmp_path / "run"), "--quiet"], capture_output=True, text=True, cwd=ROOT, check=True)
    measured = json.loads((tmp_path / "run" / "run.json").read_text())["result"]["peak_memory_mb"] / 1024
    assert 0.7 * measured <= estimated <= 1.3 * measured, (estimated, measured)
