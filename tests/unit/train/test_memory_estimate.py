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
    assert "averaged weights" not in one.parts
    averaging = tiny_config(tmp_path, ROWS, "model.scratch.n_layer=2", "train.ema_decay=0.99")
    one_averaged, ddp_averaged = memory_estimate.estimate(model, averaging, "fp32", (4, 30), 5, processes=2,
                                                          baseline=0)[:2]
    assert one_averaged.parts["averaged weights"] == ddp_averaged.parts["averaged weights"] == 4 * params
    assert one_averaged.total == one.total + 4 * params



def test_a_scorer_holds_no_vocabulary_logits(tmp_path):
    """A generative run's logits are the supervised positions' vocabulary scores, in fp32 and their gradient; a
    scoring model's outputs are a few values per row, counted as nothing."""
    config = tiny_config(tmp_path, ROWS, "model.scratch.n_layer=2")
    from qatune.train import prepare

    prepared = prepare(config, with_model=False)
    model = memory_estimate.meta_model(config, prepared.tokenizer, False)
    vocab = model.config.vocab_size
    generative = memory_estimate.estimate(model, config, "fp32", (4, 30), 5, processes=1, baseline=0)[0]
    assert generative.parts["logits"] == 4 * 5 * vocab * 4 * 2  # 4 rows x 5 supervised positions
    scoring = config.model_copy(update={"task": "scoring"})
    scored = memory_estimate.estimate(model, scoring, "fp32", (4, 30), 5, processes=1, baseline=0)[0]
    assert scored.parts["logits"] == 0
    assert scored.total == generative.total - generative.parts["logits"]

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


MEASURED = """
import json, sys
from qatune.config import load_config
from qatune.kinds import generative
from qatune.train import fit, prepare
from qatune.train.memory_estimate import estimate, resident_bytes

baseline = []
load = generative.load_pretrained

def measured_load(*args, **kwargs):
    baseline.append(resident_bytes())  # libraries, tokenizer, data: what the model adds to is above it
    return load(*args, **kwargs)

generative.load_pretrained = measured_load
config = load_config(None, [f"data.train_file={sys.argv[1]}", "model.name_or_path=smollm2-135m-instruct",
                            "train.precision=fp32", "train.speedups=off", "train.batch_size=4", "train.epochs=1"])
prepared = prepare(config)
rows, longest = config.train.batch_size, max(prepared.dataset.lengths)  # as qatune check: the widest batch
supervised = max(len(i.input_ids) - i.prompt_length for i in prepared.dataset.items)
one = estimate(prepared.model, config, prepared.precision, (rows, longest), supervised, 1, baseline=0)[0]
result = fit(prepared, None, progress=False)
print(json.dumps({"parameters": sum(p.numel() for p in prepared.model.parameters()), "estimated": one.total,
                  "measured": result["peak_memory_mb"] * 2**20 - baseline[0], "steps": result["steps"]}))
"""


@pytest.mark.slow
def test_estimate_of_what_the_model_adds_is_within_30_percent_of_the_measured_peak(tmp_path):
    """SmolLM2-135M, full fine-tuning in fp32, two steps: the estimate without its baseline (weights, gradients,
    AdamW's moments, activations, logits: 2.2 GiB) against the training process's peak less its resident set before
    the model was loaded. (The process's baseline, hundreds of MB, would hide a formula wrong on a tiny model.)"""
    rows = tmp_path / "qa.csv"
    rows.write_text("question,answer\n" + "".join(f"{q},{a}\n" for q, a in ROWS[:8]))
    done = subprocess.run([sys.executable, "-c", MEASURED, str(rows)], capture_output=True, text=True, cwd=ROOT,
                          check=False)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.splitlines()[-1])
    assert figures["parameters"] > 50e6 and figures["steps"] == 2
    estimated, measured = figures["estimated"], figures["measured"]
    assert 0.7 * measured <= estimated <= 1.3 * measured, (estimated / 2**30, measured / 2**30)


def test_a_scorer_that_fits_nowhere_is_not_advised_lora(tmp_path, monkeypatch):
    """A scoring model trains all its weights (model.lora is refused for it): check's advice leaves LoRA out,
    for a generative run it is the last thing tried."""
    rows = [(f"is item {i} good?", "yes" if i % 2 else "no") for i in range(20)]
    monkeypatch.setattr("qatune.commands.check.resident_bytes", lambda: 0)
    monkeypatch.setattr("qatune.commands.check.available_bytes", lambda: (1024, "RAM available"))
    scorer = tiny_config(tmp_path, rows, "task=scoring", "data.answer_columns=[answer]",
                         "data.field_kinds={answer: label}", "train.batch_size=8")
    warning = next(f for f in run_check(scorer)["findings"] if f["code"] == "memory")
    assert warning["message"].endswith("; none of a smaller batch, activation checkpointing or fsdp fits either")
    generative = tiny_config(tmp_path, ROWS, "train.batch_size=8", "train.activation_checkpointing=true")
    warning = next(f for f in run_check(generative)["findings"] if f["code"] == "memory")
    assert warning["message"].endswith("; none of a smaller batch, fsdp or LoRA fits either")


def test_fsdp_with_averaged_weights_is_advised_accepted_and_counted_per_shard(tmp_path, monkeypatch):
    """train.ema_decay with fsdp: each process keeps the average of its own shard, which the estimate counts; check
    advises fsdp for a run that averages its weights and accepts a config that asks for both."""
    from qatune.train import prepare

    monkeypatch.setattr("qatune.commands.check.resident_bytes", lambda: 0)
    monkeypatch.setattr("qatune.commands.check.available_bytes", lambda: (1024, "RAM available"))
    averaged = tiny_config(tmp_path, ROWS, "train.batch_size=8", "train.activation_checkpointing=true",
                           "train.ema_decay=0.99")
    report = run_check(averaged)
    warning = next(f for f in report["findings"] if f["code"] == "memory")
    assert warning["message"].endswith("; none of a smaller batch, fsdp or LoRA fits either")
    both = tiny_config(tmp_path, ROWS, "train.ema_decay=0.99", "train.distributed=fsdp")
    report = run_check(both)
    assert not [f for f in report["findings"] if f["code"] == "distributed"] and report["ok"]
    config = tiny_config(tmp_path, ROWS, "model.scratch.n_layer=2", "train.ema_decay=0.99")
    model = memory_estimate.meta_model(config, prepare(config, with_model=False).tokenizer, False)
    params = sum(p.numel() for p in model.parameters())
    ddp, fsdp = memory_estimate.estimate(model, config, "fp32", (4, 30), 5, processes=4, baseline=0)[1:]
    assert ddp.parts["averaged weights"] == 4 * params and fsdp.parts["averaged weights"] == 4 * params // 4
