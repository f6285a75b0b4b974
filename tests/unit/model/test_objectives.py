"""The training losses: padding, however wide, is masked like any other."""

import pytest
import torch

from qatune.train import prepare
from tests.conftest import MIXED_ROWS, SPAN_ROWS, one_epoch_config


@pytest.mark.parametrize(("rows", "overrides"), [
    (MIXED_ROWS, ()), (MIXED_ROWS, ("model.scratch.architecture=t5",)),
    (SPAN_ROWS, ("task=extractive", "data.context_column=context", "data.max_length=64", "data.doc_stride=16"))],
    ids=["causal", "seq2seq", "extractive"])
def test_rounded_widths_leave_loss_and_gradients_unchanged(tmp_path, rows, overrides):
    # The padding a rounded width adds is masked like any other: the same rows give the same loss and gradients.
    from qatune.kinds import kind_of
    from qatune.model.objectives import model_inputs

    prepared = prepare(one_epoch_config(tmp_path, rows, *overrides))
    model = prepared.model.eval()  # no dropout: both passes see the same function
    objective = kind_of(prepared.config.task).objective(model)
    items = [prepared.dataset[i] for i in range(min(5, len(prepared.dataset)))]

    def run(multiple):
        prepared.collator.pad_to_multiple_of = multiple
        batch = prepared.collator(items)
        model.zero_grad(set_to_none=True)
        out = objective(**model_inputs(batch))
        out["loss_sum"].backward()
        return batch["input_ids"].shape[1], out["loss_sum"].detach(), {
            name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    width, loss, grads = run(1)
    wider, rounded_loss, rounded_grads = run(width + 5)
    assert wider > width
    torch.testing.assert_close(rounded_loss, loss)
    assert rounded_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(rounded_grads[name], grad, msg=name)
