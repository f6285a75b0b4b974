"""A causal LM's loss on what it reads (qatune.speedups.causal, qatune.speedups.gpt2): each path must give the
model's own loss and gradients, and be left out whenever it would not."""

import pytest
import torch
import torch.nn.functional as F

from qatune.data.padding import IGNORE_INDEX
from qatune.speedups import gpt2 as lean_gpt2
from qatune.speedups.causal import CAUSAL_PATHS, SupervisedRowsObjective
from tests.unit.speedups.models import tiny_gpt2, tiny_llama

ALL = set(CAUSAL_PATHS)
checked = SupervisedRowsObjective.checked


def qa_batch():
    """Three rows sharing the 3-token prefix [7, 8, 9]; the last row is padded (pad id 0)."""
    input_ids = torch.tensor([
        [7, 8, 9, 11, 12, 13, 21, 22, 0],
        [7, 8, 9, 14, 15, 31, 32, 33, 0],
        [7, 8, 9, 16, 41, 0, 0, 0, 0],
    ])
    attention_mask = (torch.arange(9) < torch.tensor([[9], [9], [6]])).long()
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[0, 6:9] = input_ids[0, 6:9]   # answer 21 22 + EOS 0
    labels[1, 5:9] = input_ids[1, 5:9]   # answer 31 32 33 + EOS 0
    labels[2, 4:6] = input_ids[2, 4:6]   # answer 41 + EOS 0
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def reference_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    return F.cross_entropy(logits[:, :-1][targets != IGNORE_INDEX], targets[targets != IGNORE_INDEX],
                           reduction="sum")


def grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("shared_prefix", "tied"), [(0, True), (3, True), (3, False)])
def test_gpt2_supervised_rows_loss_and_gradients_equal_the_models_own(shared_prefix, tied):
    model = tiny_gpt2(tied=tied)
    assert (model.lm_head.weight is model.transformer.wte.weight) == tied
    batch = qa_batch()
    objective = checked(model)
    assert "gpt2_supervised_rows" in objective.paths
    expected = grads(model, reference_loss(model, batch))
    out = objective(**batch, shared_prefix=shared_prefix)
    assert out["count"] == 9
    torch.testing.assert_close(out["loss_sum"], reference_loss(model, batch), rtol=1e-5, atol=1e-5)
    got = grads(model, out["loss_sum"])
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_last_block_runs_on_the_supervised_positions_only():
    model = tiny_gpt2()
    batch = qa_batch()
    rows_seen = []
    model.transformer.h[-1].mlp.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].shape[0]))
    model.transformer.h[0].mlp.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].shape[0]))
    checked(model)(**batch, shared_prefix=3)
    # First block: the 3 shared tokens once + 3 rows x 5 remaining positions (the last of the 9 columns predicts
    # nothing and is left out); last block: the 9 supervised.
    assert rows_seen[-2:] == [3 + 3 * 5, 9]


def test_with_dropout_every_row_draws_its_own_noise_on_the_prefix():
    model = tiny_gpt2(dropout=0.3)
    model.train()
    batch = qa_batch()
    selected = batch["labels"][:, 1:] != IGNORE_INDEX
    torch.manual_seed(1)
    unshared = lean_gpt2.supervised_hidden(model, batch["input_ids"], selected, 0)
    torch.manual_seed(1)
    asked_to_share = lean_gpt2.supervised_hidden(model, batch["input_ids"], selected, 3)
    assert torch.equal(unshared, asked_to_share)  # the prefix was not shared
    assert lean_gpt2.dropout_active(model)
    model.eval()
    torch.testing.assert_close(lean_gpt2.supervised_hidden(model, batch["input_ids"], selected, 3),
                               lean_gpt2.supervised_hidden(model, batch["input_ids"], selected, 0))


def test_a_path_that_does_not_reproduce_the_model_is_not_used(monkeypatch):
    real = lean_gpt2.supervised_hidden
    monkeypatch.setattr(lean_gpt2, "supervised_hidden", lambda *args: real(*args) + 0.01)
    model = tiny_gpt2()
    objective = checked(model)
    assert "gpt2_supervised_rows" not in objective.paths and "supervised_head" in objective.paths
    batch = qa_batch()
    torch.testing.assert_close(objective(**batch, shared_prefix=3)["loss_sum"], reference_loss(model, batch))


def backbone_widths(backbone):
    """(rows, columns) of every forward of ``backbone``."""
    seen = []
    backbone.register_forward_hook(lambda module, args, kwargs, out: seen.append(tuple(kwargs["input_ids"].shape)),
                                   with_kwargs=True)
    return seen


def test_loss_path_checks_run_under_each_attention_a_bf16_cpu_run_switches_between():
    from qatune.speedups.attention import AttentionByWidth, attention_switch

    model = tiny_llama()
    switch = attention_switch(model)
    assert isinstance(switch, AttentionByWidth)
    seen = []
    model.model.register_forward_hook(lambda *_: seen.append(model.config._attn_implementation))
    objective = checked(model, attention=switch)
    assert {"shared_prefix", "last_layer_rows", "unpadded_rows"} <= objective.paths
    assert set(seen) == {"eager", "sdpa"}
    assert model.config._attn_implementation == "sdpa"  # set back after the checks


def test_other_architectures_compute_the_shared_prefix_once_through_their_cache():
    model = tiny_llama()
    objective = checked(model)
    assert {"supervised_head", "shared_prefix"} <= objective.paths and not {"gpt2_supervised_rows"} & objective.paths
    assert objective.paths == ALL - {"gpt2_supervised_rows"}
    assert objective.reasons["gpt2_supervised_rows"] == "not a GPT-2"
    batch = qa_batch()
    expected = grads(model, reference_loss(model, batch))
    seen = backbone_widths(model.model)
    out = objective(**batch, shared_prefix=3)
    # The prefix once for one row, then every row after it: 9 columns less the last (it predicts nothing) less 3.
    assert seen == [(1, 3), (3, 5)]
    torch.testing.assert_close(out["loss_sum"], reference_loss(model, batch), rtol=1e-5, atol=1e-5)
    got = grads(model, out["loss_sum"])
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    seen.clear()
    torch.testing.assert_close(objective(**batch, shared_prefix=0)["loss_sum"], out["loss_sum"])
    assert seen == [(3, 8)]  # no shared prefix: the whole batch at once


def test_lora_gradients_through_the_shared_prefix_equal_the_whole_batchs():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                    target_modules=["q_proj", "k_proj", "v_proj", "down_proj"]))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # B starts at zero: give the adapters a non-zero effect to compare
            torch.nn.init.normal_(parameter, std=0.1)
    objective = checked(model)
    assert "shared_prefix" in objective.paths
    batch = qa_batch()
    expected = grads(model, reference_loss(model, batch))
    out = objective(**batch, shared_prefix=3)
    got = grads(model, out["loss_sum"])
    assert got.keys() == expected.keys() and all("lora_" in name for name in got)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_with_dropout_the_prefix_is_computed_per_row():
    model = tiny_llama(dropout=0.2)
    model.train()
    objective = checked(model)
    assert lean_gpt2.dropout_active(model)
    seen = backbone_widths(model.model)
    objective(**qa_batch(), shared_prefix=3)
    assert seen == [(3, 8)]
    model.eval()
    seen.clear()
    objective(**qa_batch(), shared_prefix=3)
    assert seen == [(1, 3), (3, 5)]  # evaluation draws no noise: shared again


def test_a_cache_that_does_not_reproduce_the_batch_is_not_used(monkeypatch):
    from qatune.speedups import causal as lean_causal

    real = lean_causal.supervised_hidden
    monkeypatch.setattr(lean_causal, "supervised_hidden",
                        lambda model, ids, mask, selected, prefix=0, last_rows=False, groups=None, unpadded=False:
                        real(model, ids, mask, selected, prefix, last_rows, groups, unpadded)
                        + (0.01 if prefix or groups is not None else 0.0))
    model = tiny_llama()
    objective = checked(model)
    assert {"supervised_head", "last_layer_rows"} <= objective.paths and not {"shared_prefix"} & objective.paths
    assert objective.reasons["shared_prefix"] == "its check did not reproduce the model's hidden states (-v says where)"
    seen = backbone_widths(model.model)
    torch.testing.assert_close(objective(**qa_batch(), shared_prefix=3)["loss_sum"],
                               reference_loss(model, qa_batch()))
    assert seen[0] == (3, 8)


def test_full_logits_leave_out_the_last_column_with_the_same_loss_and_gradients():
    model = tiny_gpt2()
    objective = checked(model, {"last_column"})  # as for a model whose logits are not a plain head
    assert "supervised_head" not in objective.paths and "gpt2_supervised_rows" not in objective.paths
    batch = qa_batch()
    expected = grads(model, reference_loss(model, batch))
    widths = []
    model.register_forward_hook(lambda module, args, kwargs, out: widths.append(kwargs["input_ids"].shape[1]),
                                with_kwargs=True)
    out = objective(**batch)
    assert widths == [8]
    torch.testing.assert_close(out["loss_sum"], reference_loss(model, batch), rtol=1e-5, atol=1e-5)
    got = grads(model, out["loss_sum"])
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_lora_wrapped_gpt2_takes_the_lean_path_with_its_adapters():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_gpt2(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                   target_modules=["c_attn", "c_proj"], task_type="CAUSAL_LM"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)  # adapters that change the output
    objective = checked(model)
    assert "gpt2_supervised_rows" in objective.paths
    batch = qa_batch()
    expected = grads(model, reference_loss(model, batch))
    got = grads(model, objective(**batch, shared_prefix=3)["loss_sum"])
    assert set(got) == set(expected) and any("lora_A" in name for name in got)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture
def debug_log(caplog):
    """Debug records of the 'qatune' logger (the CLI turns its propagation off)."""
    import logging

    logger = logging.getLogger("qatune")
    level = logger.level
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.DEBUG)
    caplog.handler.setLevel(logging.DEBUG)
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)


def test_a_deviating_lean_path_says_why_at_debug_level(monkeypatch, debug_log):
    real = lean_gpt2.supervised_hidden
    monkeypatch.setattr(lean_gpt2, "supervised_hidden", lambda *args: real(*args) + 0.01)
    assert "gpt2_supervised_rows" not in checked(tiny_gpt2()).paths
    assert ("gpt2_supervised_rows: not used, its logits differ from the model's (shared prefix 0, attention sdpa)"
            in debug_log.text)


def test_a_failing_lean_path_logs_the_error_and_falls_back(monkeypatch, debug_log):
    def broken(*args):
        raise RuntimeError("shape mismatch in block 2")

    monkeypatch.setattr(lean_gpt2, "supervised_hidden", broken)
    model = tiny_gpt2()
    objective = checked(model)
    assert "gpt2_supervised_rows" not in objective.paths and "supervised_head" in objective.paths
    assert "gpt2_supervised_rows: not used (RuntimeError: shape mismatch in block 2)" in debug_log.text
    batch = qa_batch()
    torch.testing.assert_close(objective(**batch)["loss_sum"], reference_loss(model, batch))


def test_a_model_whose_backbone_fails_gets_full_logits_and_a_debug_line(monkeypatch, debug_log):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=50))
    real_forward = model.model.forward
    calls = {"n": 0}

    def backbone_fails_alone(*args, **kwargs):
        # The model's own forward calls the backbone too: fail only the check's direct call (the 2nd).
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("backbone needs position_ids")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model.model, "forward", backbone_fails_alone)
    objective = checked(model)
    assert "supervised_head" not in objective.paths and "gpt2_supervised_rows" not in objective.paths
    assert objective.paths == {"last_column"}
    assert objective.reasons["supervised_head"] == ("the model's logits are not a plain linear head over its last "
                                                    "hidden state")
    assert "not used for LlamaForCausalLM (ValueError: backbone needs position_ids)" in debug_log.text


def gpt2_switching_attention():
    """A tiny GPT-2 and the per-batch attention switch a bf16 run on CPU installs before its objective."""
    from qatune.speedups.attention import AttentionByWidth, attention_switch

    model = tiny_gpt2()
    switch = attention_switch(model)
    assert isinstance(switch, AttentionByWidth)
    return model, switch


def test_the_lean_path_is_checked_under_each_attention_a_bf16_cpu_run_switches_between(monkeypatch):
    model, switch = gpt2_switching_attention()
    seen = []
    real = lean_gpt2._attend
    monkeypatch.setattr(lean_gpt2, "_attend", lambda *args: seen.append(args[-1]) or real(*args))
    objective = checked(model, attention=switch)
    assert "gpt2_supervised_rows" in objective.paths
    assert set(seen) == {True, False}  # eager and SDPA


def test_a_lean_path_that_deviates_under_eager_attention_only_is_not_used(monkeypatch, debug_log):
    real = lean_gpt2._attend
    monkeypatch.setattr(lean_gpt2, "_attend", lambda *args: real(*args) + 0.01 if args[-1] else real(*args))
    assert "gpt2_supervised_rows" in checked(tiny_gpt2()).paths  # under SDPA alone it reproduces the model
    model, switch = gpt2_switching_attention()
    objective = checked(model, attention=switch)
    assert "gpt2_supervised_rows" not in objective.paths and "supervised_head" in objective.paths
    assert "its logits differ from the model's (shared prefix 0, attention eager)" in debug_log.text


@pytest.mark.parametrize("shared_prefix", [0, 3])
def test_under_eager_attention_the_lean_path_gives_the_models_own_loss_and_gradients(shared_prefix):
    model, switch = gpt2_switching_attention()
    objective = checked(model, attention=switch)
    assert "gpt2_supervised_rows" in objective.paths
    batch = qa_batch()
    with switch.forced("eager"):
        calls = []
        hook = model.transformer.h[0].attn.register_forward_hook(lambda *_: calls.append(1))
        expected = grads(model, reference_loss(model, batch))
        hook.remove()
        assert calls, "the model's own forward ran"
        out = objective(**batch, shared_prefix=shared_prefix)
    torch.testing.assert_close(out["loss_sum"], reference_loss(model, batch), rtol=1e-5, atol=1e-5)
    got = grads(model, out["loss_sum"])
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_in_bf16_the_last_block_runs_on_the_supervised_rows_rounded_up_to_64():
    model = tiny_gpt2()
    objective = checked(model)  # checked in fp32, as on CPU before bf16_master_weights turns the weights to bf16
    assert "gpt2_supervised_rows" in objective.paths
    model.to(torch.bfloat16)
    batch = qa_batch()
    selected = batch["labels"][:, 1:] != IGNORE_INDEX
    rows_seen = []
    model.transformer.h[-1].mlp.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].shape[0]))
    objective(**batch, shared_prefix=3)
    assert rows_seen == [64]
    hidden = lean_gpt2.supervised_hidden(model, batch["input_ids"], selected, 3, rows_multiple=64)
    assert rows_seen[-1] == 64 and hidden.shape == (9, 32)
    padded = grads(model, hidden.float().square().sum())
    exact = lean_gpt2.supervised_hidden(model, batch["input_ids"], selected, 3)
    assert rows_seen[-1] == 9
    torch.testing.assert_close(hidden, exact)
    for name, grad in grads(model, exact.float().square().sum()).items():
        # Sums over 64 rows (55 of them zero) and over 9 round differently in bf16: within its step of the largest.
        assert (padded[name].float() - grad.float()).abs().max() <= 2**-7 * grad.float().abs().max(), name


def test_lm_head_runs_on_a_row_count_rounded_up_to_64_and_returns_the_real_rows():
    from qatune.speedups.causal import head_on_rows
    from qatune.speedups.shapes import HEAD_ROWS_MULTIPLE

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    seen = []
    head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))
    for n in (1, 63, 64, 65):
        rows = torch.randn(n, 8, requires_grad=True)
        logits = head_on_rows(head, rows)
        assert logits.shape == (n, 11)
        torch.testing.assert_close(logits, rows @ head.weight.T)
        logits.sum().backward()                                   # the padding rows get no gradient path
        torch.testing.assert_close(rows.grad, head.weight.sum(0).expand(n, 8))
    assert seen == [64, 64, 64, 128] and HEAD_ROWS_MULTIPLE == 64


def test_gpt2_outside_its_lean_path_computes_the_prefix_per_row():
    model = tiny_gpt2()
    objective = checked(model, ALL - {"gpt2_supervised_rows"})  # gpt2_supervised_rows not listed
    assert objective.paths == {"last_column", "supervised_head"}
    assert objective.reasons["shared_prefix"] == "not measured for GPT-2 without gpt2_supervised_rows"
    expected = reference_loss(model, qa_batch())
    seen = backbone_widths(model.transformer)
    torch.testing.assert_close(objective(**qa_batch(), shared_prefix=3)["loss_sum"], expected)
    assert seen == [(3, 8)]


def test_the_last_layers_projections_run_on_the_supervised_rows_only():
    model = tiny_llama()
    objective = checked(model)
    assert "last_layer_rows" in objective.paths
    inputs = []
    for layer in model.model.layers:
        for module in (layer.self_attn.o_proj, layer.mlp):
            module.register_forward_hook(lambda module, args, out: inputs.append(tuple(args[0].shape)))
    batch = qa_batch()
    expected = grads(model, reference_loss(model, batch))
    inputs.clear()
    out = objective(**batch, shared_prefix=3)
    # Layer 0 on every real position (the prefix for one row, then the rest of each row: 5 + 5 + 3 real of the 3 x 5
    # columns after the prefix); layer 1 on the 9 supervised.
    assert inputs == [(1, 3, 32), (1, 3, 32), (1, 3, 32), (1, 3, 32), (13, 32), (13, 32), (9, 32), (9, 32)]
    got = grads(model, out["loss_sum"])
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_gpt2_outside_its_lean_path_keeps_its_last_block_whole():
    model = tiny_gpt2()
    objective = checked(model, ALL - {"gpt2_supervised_rows"})
    assert {"supervised_head"} <= objective.paths and not {"last_layer_rows", "shared_prefix"} & objective.paths


def grouped_batch():
    """Rows 0, 1 and 3 share the 5-token prefix [7, 8, 9, 11, 12] (one context), row 2 only [7, 8, 9]."""
    from qatune.data.generative import CausalCollator, Example
    from qatune.model.objectives import model_inputs
    from qatune.speedups.prefixes import PrefixPlanner

    examples = [Example([7, 8, 9, 11, 12, 13, 21, 22, 0], prompt_length=6, row=0),
                Example([7, 8, 9, 11, 12, 14, 31, 32, 0], prompt_length=6, row=1),
                Example([7, 8, 9, 16, 41, 0], prompt_length=4, row=2),
                Example([7, 8, 9, 11, 12, 15, 17, 43, 0], prompt_length=7, row=3)]
    planner = PrefixPlanner(CausalCollator(pad_token_id=0, uncounted_columns=1), shared=True, groups=True)
    return model_inputs(planner(examples))


@pytest.mark.parametrize("lora", [False, True])
def test_each_groups_prefix_is_computed_once_with_the_whole_batchs_loss_and_gradients(lora):
    from peft import LoraConfig, get_peft_model

    model = tiny_llama()
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "down_proj"]))
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(parameter, std=0.1)
    objective = checked(model)
    assert {"prefix_groups", "shared_prefix", "last_layer_rows"} <= objective.paths
    batch = grouped_batch()
    assert batch["prefix_groups"]["group"].tolist() == [0, 0, 1, 0]
    expected = grads(model, reference_loss(model, batch))
    seen = backbone_widths(objective.model.get_base_model().model if lora else model.model)
    out = objective(**batch)
    # Two prefixes of 5 columns (row 2's 3 tokens padded), then the rest of each row: 3 columns (to position 7).
    assert seen == [(2, 5), (4, 3)]
    torch.testing.assert_close(out["loss_sum"], reference_loss(model, batch), rtol=1e-5, atol=1e-5)
    assert int(out["count"]) == 3 + 3 + 2 + 2
    got = grads(model, out["loss_sum"])
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_each_rows_group_keys_are_picked_with_index_select_and_other_caches_keep_their_own_pick():
    from transformers import DynamicCache

    from qatune.speedups.causal import _select_rows

    keys = torch.randn(3, 2, 4, 5, requires_grad=True)
    values = torch.randn(3, 2, 4, 5, requires_grad=True)
    cache = DynamicCache()
    cache.update(keys, values, 0)
    group = torch.tensor([0, 0, 2, 1, 0])
    _select_rows(cache, group)
    picked = cache.layers[0]
    assert type(picked.keys.grad_fn).__name__ == "IndexSelectBackward0"  # not IndexBackward0's index_put_
    assert torch.equal(picked.keys, keys[group]) and torch.equal(picked.values, values[group])
    (picked.keys.sum() + 2 * picked.values.sum()).backward()
    assert keys.grad[:, 0, 0, 0].tolist() == [3.0, 1.0, 1.0]  # row 0 feeds three rows, the others one each
    assert values.grad[:, 0, 0, 0].tolist() == [6.0, 2.0, 2.0]

    class Other:
        def __init__(self):
            self.layers = [object()]

        def batch_select_indices(self, index):
            self.picked = index

    other = Other()
    _select_rows(other, group)
    assert other.picked is group


def test_groups_that_do_not_reproduce_the_batch_are_not_used(monkeypatch):
    from qatune.speedups import causal as lean_causal

    real = lean_causal._grouped
    monkeypatch.setattr(lean_causal, "_grouped", lambda *args: real(*args) + 0.01)
    model = tiny_llama()
    objective = checked(model)
    assert "shared_prefix" in objective.paths and "prefix_groups" not in objective.paths
    assert objective.reasons["prefix_groups"] == "its check did not reproduce the model's hidden states (-v says where)"
    batch = grouped_batch()
    expected = reference_loss(model, batch)
    seen = backbone_widths(model.model)
    torch.testing.assert_close(objective(**batch)["loss_sum"], expected, rtol=1e-5, atol=1e-5)
    assert seen == [(1, 3), (4, 5)]  # the batch's common prefix instead


def test_sliding_window_models_share_only_the_batchs_common_prefix():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                             sliding_window=16))
    objective = checked(model)
    # A group's padded prefix would put padding slots inside the window: only the common prefix is shared.
    assert "shared_prefix" in objective.paths and "prefix_groups" not in objective.paths
    assert objective.reasons["prefix_groups"] == ("sliding-window attention counts cache slots, which a group's "
                                                  "padding shifts")
    batch = grouped_batch()
    torch.testing.assert_close(objective(**batch)["loss_sum"], reference_loss(model, batch), rtol=1e-5, atol=1e-5)


def position_wise_inputs(model):
    """The shape of every input to layer 0's query projection and MLP, in call order."""
    seen = []
    layer = model.model.layers[0]
    for module in (layer.self_attn.q_proj, layer.mlp):
        module.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    return seen


def lora_llama():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.1)
    return model


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("shared_prefix", [0, 3])
def test_projections_and_mlps_run_on_the_real_tokens_with_the_whole_batchs_loss_and_gradients(lora, shared_prefix):
    model = lora_llama() if lora else tiny_llama()
    objective = checked(model)
    assert "unpadded_rows" in objective.paths and "last_layer_rows" in objective.paths
    batch = qa_batch()
    expected = grads(model, reference_loss(model, batch))
    seen = position_wise_inputs(objective.model.get_base_model() if lora else model)
    out = objective(**batch, shared_prefix=shared_prefix)
    # Rows of 8, 8 and 6 real tokens in 8 columns (the last one predicts nothing and is left out); with the 3-token
    # prefix once (no padding in it), the rest of each row: 5 + 5 + 3 real in 3 x 5 columns.
    assert seen == ([(22, 32), (22, 32)] if not shared_prefix else [(1, 3, 32), (1, 3, 32), (13, 32), (13, 32)])
    torch.testing.assert_close(out["loss_sum"], reference_loss(model, batch), rtol=1e-5, atol=1e-5)
    got = grads(model, out["loss_sum"])
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_group_prefixes_and_their_rows_run_on_the_real_tokens_only():
    model = lora_llama()
    objective = checked(model)
    assert "prefix_groups" in objective.paths and "unpadded_rows" in objective.paths
    batch = grouped_batch()
    expected = grads(model, reference_loss(model, batch))
    seen = position_wise_inputs(objective.model.get_base_model())
    out = objective(**batch)
    # Two group prefixes of 5 columns, row 2's of 3 real tokens; then each row's rest: 3 real columns each (row 2's
    # from position 3), no padding, so whole.
    assert seen == [(8, 32), (8, 32), (4, 3, 32), (4, 3, 32)]
    torch.testing.assert_close(out["loss_sum"], reference_loss(model, batch), rtol=1e-5, atol=1e-5)
    got = grads(model, out["loss_sum"])
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_in_bf16_the_real_tokens_are_rounded_up_to_64_rows_with_the_same_loss_and_gradients():
    """A batch's real tokens are a new count at almost every step; oneDNN keeps a kernel per count it meets, so
    memory climbed with every step. Rounded up with zero rows, the products meet one shape per 64 tokens."""
    model = tiny_llama()
    objective = checked(model)  # checked in fp32, as on CPU before bf16_master_weights turns the weights to bf16
    assert "unpadded_rows" in objective.paths
    model.to(torch.bfloat16)
    batch = qa_batch()
    seen = position_wise_inputs(model)
    out = objective(**batch)
    assert seen == [(64, 32), (64, 32)]  # 22 real tokens, and 42 zero rows
    got = grads(model, out["loss_sum"])
    expected = reference_loss(model, batch)
    torch.testing.assert_close(out["loss_sum"].float(), expected.float(), rtol=2**-7, atol=0)
    for name, grad in grads(model, expected).items():
        # Sums over 64 rows (42 of them zero) and over the batch's 24 round differently in bf16: within a step
        assert (got[name].float() - grad.float()).abs().max() <= 2**-6 * grad.float().abs().max(), name


def test_rows_without_padding_keep_their_shape():
    model = tiny_llama()
    objective = checked(model)
    batch = {key: value[:2] for key, value in qa_batch().items()}  # the two rows of 9 tokens
    expected = reference_loss(model, batch)
    seen = position_wise_inputs(model)
    torch.testing.assert_close(objective(**batch)["loss_sum"], expected, rtol=1e-5, atol=1e-5)
    assert seen == [(2, 8, 32), (2, 8, 32)]


class TokenShift(torch.nn.Module):
    """An MLP that also mixes each position with the one before it (as RWKV's token shift does)."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x) + 0.5 * torch.cat([torch.zeros_like(x[..., :1, :]), x[..., :-1, :]], dim=-2)


def test_a_module_that_mixes_positions_is_not_run_on_the_real_tokens_only(debug_log):
    model = tiny_llama()
    model.model.layers[0].mlp = TokenShift(model.model.layers[0].mlp)
    objective = checked(model)
    # The model's own check sees the difference: gathered, the rows would shift into each other.
    assert "last_layer_rows" in objective.paths and "unpadded_rows" not in objective.paths
    assert "unpadded_rows: not used, the hidden states differ" in debug_log.text
    batch = qa_batch()
    expected = reference_loss(model, batch)
    seen = position_wise_inputs(model)
    torch.testing.assert_close(objective(**batch)["loss_sum"], expected, rtol=1e-5, atol=1e-5)
    assert seen == [(3, 8, 32), (3, 8, 32)]


def test_under_gradient_checkpointing_the_backbone_runs_whole():
    model = tiny_llama()
    model.gradient_checkpointing_enable()
    model.train()
    objective = checked(model)
    # Its recomputed forwards would run without the hooks that pick rows, and without the cache.
    assert objective.paths == {"last_column", "supervised_head"}
    assert objective.reasons["unpadded_rows"] == "gradient checkpointing recomputes forwards without the row hooks"
    batch = qa_batch()
    expected = grads(model, reference_loss(model, batch))
    out = objective(**batch, shared_prefix=3)
    got = grads(model, out["loss_sum"])
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_lora_on_a_llama_keeps_the_lm_head_on_supervised_positions_only():
    """peft's own ``model`` attribute must not be taken for Llama's backbone (base_model_prefix "model")."""
    pytest.importorskip("peft")
    import torch

    from qatune.config import LoraSettings
    from qatune.model.adapters import apply_lora
    from qatune.speedups.causal import SupervisedRowsObjective
    from qatune.speedups.gpt2 import has_dropout
    from tests.conftest import chat_tokenizer
    from tests.conftest import tiny_llama as chat_llama

    tokenizer = chat_tokenizer()
    model = apply_lora(chat_llama(tokenizer), LoraSettings(r=4, target_modules=["q_proj", "v_proj"]), "generative")
    objective = SupervisedRowsObjective.checked(model)
    assert {"supervised_head", "last_layer_rows", "unpadded_rows"} <= objective.paths
    assert has_dropout(model)  # LoRA's dropout: while training, prompt prefixes are computed per row
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    labels = torch.tensor([[-100, -100, -100, 8, 9, 10]])
    model.eval()
    out = objective(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    reference = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
    assert torch.allclose(out["loss_sum"] / out["count"], reference, atol=1e-5)
