"""folded_clipping: clipping folded into the fused AdamW update gives torch's clipped update."""

import copy
import math

import pytest
import torch

from qatune.train.optim import build_optimizer


@pytest.mark.parametrize("max_norm", [0.01, 1e6, None])
def test_clipping_folded_into_fused_adamw_gives_torchs_clipped_update(max_norm):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from qatune.speedups.clipping import folded_clipper

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    reference = copy.deepcopy(model)
    model(torch.randn(5, 8)).pow(2).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        q.grad = p.grad.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm or math.inf)
    torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.0, foreach=False).step()

    optimizer = build_optimizer(model, 0.1, 0.0)
    assert optimizer.defaults["fused"]
    accelerator = SimpleNamespace(scaler=None, distributed_type=DistributedType.NO)
    norm = folded_clipper(accelerator, optimizer, max_norm)()
    optimizer.step()
    torch.testing.assert_close(norm, expected_norm)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(p.grad, q.grad)  # the gradients the update used, clipped


def test_total_norm_on_cpu_is_the_float64_norm_and_keeps_inf_and_nan():
    from qatune.speedups.clipping import total_norm

    torch.manual_seed(0)
    grads = [torch.randn(300, 700), torch.randn(5), torch.randn(64, 64).t()]  # one not contiguous
    exact = math.sqrt(sum(g.double().pow(2).sum().item() for g in grads))
    assert total_norm(grads).dtype == torch.float32
    assert total_norm(grads).item() == pytest.approx(exact, rel=1e-6)
    assert total_norm([]).item() == 0.0
    assert total_norm([torch.ones(3), torch.tensor([1.0, math.inf])]).item() == math.inf
    assert math.isnan(total_norm([torch.ones(3), torch.tensor([math.nan])]).item())
    # Other dtypes keep torch's norm kernels.
    half = [g.bfloat16() for g in grads]
    assert total_norm(half).item() == pytest.approx(exact, rel=1e-2)
