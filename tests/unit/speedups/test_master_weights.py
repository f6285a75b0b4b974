"""bf16 training on CPU: bf16 weights, fp32 masters in the optimizer (qatune.speedups.master_weights)."""

import json
import logging
import os

import pytest
import torch

from qatune.speedups.master_weights import MasterWeights, applies
from tests.conftest import speedups_on, tiny_config

ROWS = [(f"what is item {i}?", f"item {i} is {w}") for i, w in enumerate(
    ["red", "blue", "green", "apple", "river", "stone", "cloud", "north", "seven", "paper", "glass", "tiger"])]


def tiny_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2))


def test_only_bf16_on_cpu_in_one_process():
    assert applies("bf16", "cpu", 1) is None
    assert applies("fp32", "cpu", 1) == "fp32 run"
    assert applies("bf16", "cuda", 1) == "CPU only (a GPU trains under autocast)"
    assert applies("bf16", "cpu", 2) == "one process only (several reduce the model's own gradients)"


def test_weights_become_bf16_and_the_masters_keep_the_fp32_values():
    model = tiny_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    masters = MasterWeights(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert [m.dtype for m in masters.masters] == [torch.float32] * len(masters.masters)
    for name, master in zip(masters.names, masters.masters):
        assert torch.equal(master, before[name])
    with masters.full_precision():
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 and torch.equal(p, before[name])
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    masters.release()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[name])


def test_micro_batch_gradients_add_up_in_fp32():
    model = tiny_model()
    masters = MasterWeights(model)
    ids = torch.tensor([[1, 2, 3, 4]])
    expected = None
    for scale in (1.0, 3.0):
        (model(input_ids=ids, labels=ids).loss * scale).backward()
        grads = [p.grad.float() for p in masters.params]
        expected = grads if expected is None else [a + b for a, b in zip(expected, grads)]
        masters.accumulate()
        assert all(p.grad is None for p in masters.params)
    for master, want in zip(masters.masters, expected):
        assert master.grad.dtype == torch.float32
        torch.testing.assert_close(master.grad, want, rtol=0, atol=0)
    assert [name for name, _ in masters.named_grads()] == masters.names      # what a non-finite step reports
    # After the optimizer's zero_grad the next window starts from zero, in the same buffers.
    buffers = [m.grad.data_ptr() for m in masters.masters]
    for m in masters.masters:
        m.grad = None
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad.float() for p in masters.params]
    masters.accumulate()
    assert [m.grad.data_ptr() for m in masters.masters] == buffers
    for master, want in zip(masters.masters, grads):
        torch.testing.assert_close(master.grad, want, rtol=0, atol=0)


def test_updates_smaller_than_a_bf16_step_are_kept_by_the_masters():
    model = tiny_model()
    masters = MasterWeights(model)
    weight = model.transformer.ln_f.weight            # all ones: a bf16 step there is 2**-7
    index = masters.names.index("transformer.ln_f.weight")
    optimizer = torch.optim.SGD(masters.masters, lr=1e-3)
    for _ in range(10):                               # ten updates of 1e-3: each is under half a bf16 step
        for master in masters.masters:
            master.grad = torch.ones_like(master)
        optimizer.step()
        masters.refresh()
    torch.testing.assert_close(masters.masters[index], torch.full_like(masters.masters[index], 0.99))
    assert torch.equal(weight, torch.full_like(weight, 0.99).to(torch.bfloat16))
    # bf16 weights updated alone would not have moved at all:
    alone = torch.ones(4, dtype=torch.bfloat16)
    for _ in range(10):
        alone -= 1e-3
    assert torch.equal(alone, torch.ones(4, dtype=torch.bfloat16))


def test_bf16_training_on_cpu_saves_fp32_weights_and_final_links_the_last_checkpoint(tmp_path, caplog):
    from safetensors.torch import load_file

    from qatune.runs import atomic, layout
    from qatune.train import train
    from qatune.train.checkpoint import list_checkpoints

    config = tiny_config(tmp_path, ROWS, "train.precision=bf16", "train.epochs=2", "train.batch_size=4",
                         "train.learning_rate=3e-3")
    with caplog.at_level(logging.INFO, logger="qatune"):
        run = train(config, output_dir=tmp_path / "run", progress=False)
    assert "bf16_master_weights" in speedups_on(caplog)
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if json.loads(line).get("event") == "train"]
    assert losses[-1] < losses[0]
    final = run / layout.FINAL / "model.safetensors"
    assert {t.dtype for t in load_file(final).values()} == {torch.float32}
    last = list_checkpoints(run)[-1]
    assert os.stat(final).st_ino == os.stat(last / "model.safetensors").st_ino     # written once
    assert atomic.damage(run / layout.FINAL) is None
    assert not (run / layout.FINAL / "optimizer.pt").exists()


def test_bf16_training_on_cpu_picks_the_attention_of_each_batch_by_its_width(tmp_path, caplog, monkeypatch):
    from qatune.speedups import attention as model_module
    from qatune.train import train

    widths, used = [], []
    real_use = model_module.AttentionByWidth.use

    def use(self, width):
        real_use(self, width)
        widths.append(width)
        used.append(self.config._attn_implementation)

    monkeypatch.setattr(model_module.AttentionByWidth, "use", use)
    monkeypatch.setattr(model_module, "EAGER_ATTENTION_MAX_TOKENS", 18)  # the batches (17-21 wide) straddle it
    config = tiny_config(tmp_path, ROWS, "train.precision=bf16", "train.epochs=1", "train.batch_size=3")
    with caplog.at_level(logging.INFO, logger="qatune"):
        train(config, output_dir=tmp_path / "run", progress=False)
    assert "attention_by_width" in speedups_on(caplog)
    assert "attention: eager for batches of at most 18 tokens, SDPA for wider ones" in caplog.text
    assert len(widths) == 4  # one per batch: 12 rows, 3 per batch
    assert used == ["eager" if width <= 18 else "sdpa" for width in widths]
    assert {"eager", "sdpa"} <= set(used), widths


def test_resuming_bf16_training_continues_from_the_fp32_masters(tmp_path):
    from safetensors.torch import load_file

    from qatune.runs import layout
    from qatune.train import train

    def config(epochs):
        return tiny_config(tmp_path, ROWS, "train.precision=bf16", f"train.epochs={epochs}", "train.batch_size=4",
                           "train.learning_rate=3e-3", "model.scratch.dropout=0.0")

    whole = train(config(2), output_dir=tmp_path / "whole", progress=False)
    half = train(config(1), output_dir=tmp_path / "half", progress=False)
    resumed = train(config(2), output_dir=tmp_path / "half", resume="", progress=False)
    a = load_file(whole / layout.FINAL / "model.safetensors")
    b = load_file(resumed / layout.FINAL / "model.safetensors")
    assert half == resumed
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_lora_under_bf16_trains_fp32_adapters_over_a_bf16_base_and_keeps_base_in_fp32(tmp_path):
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    from qatune.runs import layout
    from qatune.train import train

    config = tiny_config(tmp_path, ROWS, "model.scratch.n_layer=2", "model.scratch.n_embd=64", "model.lora.r=8",
                         "model.lora.alpha=16", "model.lora.dropout=0.0", "train.precision=bf16", "train.epochs=6",
                         "train.batch_size=4", "train.learning_rate=1e-2")
    run = train(config, output_dir=tmp_path / "run", progress=False)
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[-3:]) < sum(losses[:3])
    for folder, name in ((layout.FINAL, "adapter_model.safetensors"), (layout.BASE, "model.safetensors")):
        assert {t.dtype for t in load_file(run / folder / name).values()} == {torch.float32}, folder
