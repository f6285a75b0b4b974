"""The NaN guard: a non-finite step is caught at once, explained, never applied."""

import json
import logging
import math

import pytest
import torch

from qatune.errors import TrainingError
from qatune.train import LengthGroupedBatches, fit, prepare, train
from tests.conftest import tiny_config

ROWS = [(f"question number {i}", f"answer {i}") for i in range(12)]


def config_for(tmp_path, *overrides):
    return tiny_config(tmp_path, ROWS, "train.epochs=2", "train.batch_size=4", "train.learning_rate=1e-3", *overrides)


def poison_forward(model, at_calls):
    """Make the token embeddings infinite on the given training forward calls (1-based)."""
    calls = {"n": 0}

    def hook(module, inputs, output):
        if not module.training:
            return output       # evaluation and setup checks are left alone
        calls["n"] += 1
        return output * math.inf if calls["n"] in at_calls else output

    model.get_input_embeddings().register_forward_hook(hook)


def rows_of_batch(prepared, epoch, index):
    sampler = LengthGroupedBatches(prepared.dataset.lengths, prepared.config.train.batch_size, prepared.config.seed)
    sampler.set_epoch(epoch)
    return sorted(prepared.dataset[i].row for i in list(sampler)[index])


def test_first_bad_step_stops_with_a_diagnosis_naming_the_rows(tmp_path):
    prepared = prepare(config_for(tmp_path, "train.max_nonfinite_steps=1"))
    poison_forward(prepared.model, at_calls={1})
    with pytest.raises(TrainingError) as err:
        fit(prepared, tmp_path, progress=False)
    assert "1 non-finite step(s) (steps [1])" in str(err.value)
    assert "Likely causes, in order:" in str(err.value)
    diagnosis = json.loads((tmp_path / "nonfinite-step-1.json").read_text())
    assert sorted(diagnosis["rows"]) == rows_of_batch(prepared, 0, 0)
    assert diagnosis["precision"] == "fp32" and diagnosis["lr"] == pytest.approx(1e-3)   # no warmup: the peak
    assert (diagnosis["largest_abs_logit"] in (math.inf, "inf")
            or not math.isfinite(float(diagnosis["largest_abs_logit"])))
    assert diagnosis["non_finite_grad_layers"] and diagnosis["largest_grad_norms"]  # read before zero_grad
    assert all(torch.isfinite(p).all() for p in prepared.model.parameters())   # the bad update was not applied


def test_skip_continues_and_finishes_finite(tmp_path):
    prepared = prepare(config_for(tmp_path, "train.on_nonfinite=skip"))
    poison_forward(prepared.model, at_calls={2, 5})
    result = fit(prepared, tmp_path, progress=False)
    assert result["nonfinite_steps"] == [2, 4]         # forward 5 is the 4th attempted step after one was skipped
    assert result["steps"] == 6 - 2 and math.isfinite(result["final_train_loss"])
    assert all(torch.isfinite(p).all() for p in prepared.model.parameters())
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged] == [1, 2, 3, 4] and all(math.isfinite(line["loss"]) for line in logged)


def test_skip_gives_up_after_too_many_bad_steps_in_a_row(tmp_path):
    prepared = prepare(config_for(tmp_path, "train.on_nonfinite=skip", "train.max_nonfinite_steps=2"))
    poison_forward(prepared.model, at_calls={1, 2, 3})
    with pytest.raises(TrainingError, match=r"2 non-finite step\(s\)"):
        fit(prepared, tmp_path, progress=False)


def test_the_best_model_from_before_is_never_overwritten(tmp_path, monkeypatch):
    from qatune.kinds import generative as prepare_module

    original = prepare_module.build_scratch

    def poisoned_build(*args, **kwargs):
        model = original(*args, **kwargs)
        poison_forward(model, at_calls=set(range(4, 100)))   # epoch 1 (3 steps + eval) is healthy
        return model

    monkeypatch.setattr(prepare_module, "build_scratch", poisoned_build)
    config = config_for(tmp_path, "data.validation_fraction=0.25", "train.max_nonfinite_steps=1")
    run = tmp_path / "run"
    with pytest.raises(TrainingError):
        train(config, output_dir=run, progress=False)
    best = run / "best" / "model.safetensors"
    assert best.is_file()                       # saved after the healthy epoch 1
    assert not (run / "final").exists()         # the run never claims to be complete
    status = json.loads((run / "run.json").read_text())
    assert status["status"] == "failed" and "non-finite" in status["error"]
    from safetensors.torch import load_file

    assert all(torch.isfinite(t).all() for t in load_file(best).values())
    assert json.loads((run / "nonfinite-step-4.json").read_text())["epoch"] == 2


def test_a_batch_without_supervised_tokens_is_skipped_with_a_warning(tmp_path, caplog):
    prepared = prepare(config_for(tmp_path, "train.epochs=1"))
    collate = prepared.collator
    seen = {"n": 0}

    def collate_some_empty(items):  # a user's collator: no host-side counts, labels all -100 once
        batch = collate(items)
        del batch["n_items"], batch["n_tokens"]
        seen["n"] += 1
        if seen["n"] == 2:
            batch["labels"][:] = -100
        return batch

    prepared.collator = collate_some_empty
    with caplog.at_level(logging.WARNING, logger="qatune"):
        result = fit(prepared, None, progress=False)
    assert result["steps"] == 2
    assert "a batch with no supervised tokens" in caplog.text
