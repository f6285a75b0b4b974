"""fit(), the loop: when the optimizer steps, what one update is, clipping and its log, seeds, the widths
of its batches."""

import json
import logging
import math

import pytest
import torch

from qatune.train import build_optimizer, fit, prepare
from tests.conftest import MIXED_ROWS, one_epoch_config


class StepSpy:
    """Records, at every optimizer step, how many backward passes ran and the gradient norm."""

    def __init__(self, monkeypatch):
        self.backwards = 0
        self.at_step = []
        self.norms = []
        original = build_optimizer

        def spying_build(params, lr, wd):
            optimizer = original(params, lr, wd)
            params[0].register_hook(self._count)  # the embedding: one call per backward
            step = optimizer.step

            def recorded_step(*args, **kwargs):
                self.at_step.append(self.backwards)
                out = step(*args, **kwargs)
                # After the step: the fused AdamW applies the clipping inside its kernel and leaves the
                # gradients it used behind.
                grads = [p.grad.norm() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                self.norms.append(float(torch.stack(grads).norm()))
                return out

            optimizer.step = recorded_step
            return optimizer

        monkeypatch.setattr("qatune.train.loop.build_optimizer", spying_build)

    def _count(self, grad):
        self.backwards += 1
        return grad


def test_first_optimizer_step_after_exactly_n_micro_batches(tmp_path, monkeypatch):
    spy = StepSpy(monkeypatch)
    config = one_epoch_config(tmp_path, MIXED_ROWS, "train.batch_size=2", "train.gradient_accumulation_steps=3")
    fit(prepare(config), tmp_path, progress=False)
    # 14 rows / 2 = 7 micro-batches -> steps after micro-batches 3, 6 and the short last window 7.
    assert spy.at_step == [3, 6, 7]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]


def test_accumulation_gives_the_same_update_as_one_large_batch(tmp_path, monkeypatch):
    # Plain SGD: the update is the gradient itself (Adam's first step would hide its scale).
    monkeypatch.setattr("qatune.train.loop.build_optimizer",
                        lambda params, lr, wd: torch.optim.SGD(params, lr=1.0))
    rows = [("q1", "yes"), ("q2", "no"), ("q3", "ok"), ("q4", "a much longer answer with many more words")]
    big = prepare(one_epoch_config(tmp_path, rows, "train.batch_size=4", "train.group_by_length=false"))
    small = prepare(one_epoch_config(tmp_path, rows, "train.batch_size=2", "train.gradient_accumulation_steps=2",
                                     "train.group_by_length=false"))
    assert all(torch.equal(a, b) for a, b in zip(big.model.parameters(), small.model.parameters()))
    before = [p.detach().clone() for p in big.model.parameters()]
    fit(big, None, progress=False)
    fit(small, None, progress=False)
    assert any(not torch.allclose(a, b.cpu()) for a, b in zip(before, big.model.parameters()))
    # The micro-batches hold different numbers of answer tokens; the loss is normalised by the tokens of
    # the whole window, so the two updates agree.
    for a, b in zip(big.model.parameters(), small.model.parameters()):
        torch.testing.assert_close(a.cpu(), b.cpu(), atol=1e-6, rtol=1e-5)


def test_gradients_are_clipped_and_the_norm_before_clipping_is_logged(tmp_path, monkeypatch):
    spy = StepSpy(monkeypatch)
    config = one_epoch_config(tmp_path, MIXED_ROWS, "train.batch_size=7", "train.max_grad_norm=0.001")
    fit(prepare(config), tmp_path, progress=False)
    assert spy.norms and all(norm <= 0.001 * (1 + 1e-4) for norm in spy.norms)
    logged = [json.loads(line)["grad_norm"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == len(spy.norms) and all(norm > 0.01 for norm in logged)


def test_same_seed_same_run(tmp_path):
    a = prepare(one_epoch_config(tmp_path, MIXED_ROWS, "train.batch_size=4", "model.scratch.dropout=0.1"))
    fit(a, None, progress=False)
    b = prepare(one_epoch_config(tmp_path, MIXED_ROWS, "train.batch_size=4", "model.scratch.dropout=0.1"))
    fit(b, None, progress=False)
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))


def test_the_log_names_families_kept_together_only_when_group_by_prefix_keeps_some(tmp_path, caplog):
    from qatune.train.loop import Loop

    passages = [" ".join(f"{word}{k}" for k in range(30)) for word in ("river", "mountain")]
    rows = [(f"question {i} about it", passages[i % 2], f"answer {i}") for i in range(8)]
    said = {}
    with_context = ["data.context_column=context"]
    for name, data, overrides in [("default", rows, with_context),
                                  ("kept", rows, [*with_context, "train.group_by_prefix=true"]),
                                  ("no contexts", MIXED_ROWS, ["train.group_by_prefix=true"]),
                                  ("prompts trained", rows, [*with_context, "train.group_by_prefix=true",
                                                             "train.train_on_prompt=true"])]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="qatune"):
            Loop.setup(prepare(one_epoch_config(tmp_path, data, "train.batch_size=4", *overrides)), None, None)
        said[name] = [m for m in caplog.messages if m.startswith("batches:")]
    assert said["default"] == []  # off, the sampler has nothing to say
    assert len(said["kept"]) == 1 and said["kept"][0].startswith(
        "batches: 8 of 8 rows in 2 groups that share a long prompt prefix (one context) kept together, ")
    assert said["no contexts"] == ["batches: train.group_by_prefix keeps no rows together: no rows share a long "
                                   "prompt prefix (one context)"]
    assert said["prompts trained"] == ["batches: train.group_by_prefix keeps no rows together: the prompts are "
                                       "trained on too (train.train_on_prompt)"]


@pytest.mark.parametrize(("precision", "multiple"), [("bf16", 2), ("fp32", 1)])
def test_training_batches_have_widths_rounded_for_the_precision(tmp_path, precision, multiple):
    rows = [*MIXED_ROWS, *((f"question number {i} of three", "yes") for i in range(4))]  # rows of other lengths
    prepared = prepare(one_epoch_config(tmp_path, rows, f"train.precision={precision}", "train.batch_size=3",
                                        "train.device=cpu"))
    collate, widths = prepared.collator, []

    def recording(items):
        batch = collate(items)
        widths.append((max(len(item) for item in items), batch["input_ids"].shape[1]))
        return batch

    fit(prepared, None, progress=False)  # sets the multiple on the run's collator
    assert collate.pad_to_multiple_of == multiple
    prepared.collator = recording  # a plain function: the second fit leaves the collator as the first set it
    fit(prepared, None, progress=False)
    # The model computes all but a batch's last column (it predicts nothing): that width is the rounded one.
    assert any((longest - 1) % 2 for longest, _ in widths)  # some batch's computed width would be odd
    assert all(width - 1 == -(-(longest - 1) // multiple) * multiple for longest, width in widths)


def test_bf16_training_with_rows_as_long_as_an_odd_position_count(tmp_path):
    # Rounded to even, a 17-token batch would index position 17 of a model that has 17 (0..16).
    rows = [(" ".join(f"word{j}" for j in range(i, i + 12)), "yes") for i in range(6)]
    config = one_epoch_config(tmp_path, rows, "model.scratch.n_positions=17", "data.max_length=17",
                              "train.precision=bf16", "train.device=cpu", "train.batch_size=3")
    prepared = prepare(config)
    assert max(prepared.dataset.lengths) == 17
    result = fit(prepared, None, progress=False)
    assert prepared.collator.pad_to_multiple_of == 2
    assert math.isfinite(result["final_train_loss"])
