"""AdamW's parameter groups and the warmup + StepLR schedule."""

import pytest
import torch

from qatune.train import build_optimizer, build_schedulers
from tests.conftest import MIXED_ROWS, one_epoch_config


def test_step_lr_after_warmup(tmp_path):
    config = one_epoch_config(tmp_path, MIXED_ROWS, "train.learning_rate=0.1", "train.warmup_steps=4",
                              "train.scheduler.step_size=3", "train.scheduler.gamma=0.5",
                              "train.scheduler.interval=step")
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    warmup, decay = build_schedulers(optimizer, config)
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        warmup.step()
        decay.step()
    expected = [0.1 * min(1.0, (k + 1) / 4) * 0.5 ** (k // 3) for k in range(10)]
    assert seen == pytest.approx(expected)


def test_step_lr_per_epoch(tmp_path):
    config = one_epoch_config(tmp_path, MIXED_ROWS, "train.learning_rate=0.1", "train.scheduler.step_size=2",
                              "train.scheduler.gamma=0.1")
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    warmup, decay = build_schedulers(optimizer, config)
    assert warmup is None
    seen = []
    for _epoch in range(5):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        decay.step()
    assert seen == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001])


def test_no_weight_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, 1e-3, 0.1)
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert [p.shape for p in decayed["params"]] == [torch.Size([4, 4])]
    assert len(plain["params"]) == 3
