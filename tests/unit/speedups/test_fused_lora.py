"""LoRA layers' one-pass product (qatune.speedups.fused_lora): the same outputs and gradients as peft's own forward,
and peft's forward wherever the one-pass product would not compute the same thing."""

import pytest
import torch
from torch import nn

pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model

from qatune.model.objectives import CausalLMObjective
from qatune.speedups import fused_lora as lean_lora

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama_with_lora(dropout: float = 0.0, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=50))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=PROJECTIONS,
                                             task_type="CAUSAL_LM"))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: the adapter's products would not show
            nn.init.normal_(param, std=0.2)
    return model


def loss_and_grads(model):
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 0, 0]])
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def backward_kinds(model):
    """The grad_fn class name of every LoRA layer's output in the next forward."""
    seen = []
    for module in model.modules():
        if type(module).__name__ == "Linear" and hasattr(module, "lora_A"):
            module.register_forward_hook(lambda m, args, out: seen.append(type(out.grad_fn).__name__))
    return seen


def test_one_pass_lora_gives_peft_losses_and_gradients():
    model = llama_with_lora()
    expected_loss, expected = loss_and_grads(model)
    assert lean_lora.install(model) == 2 * len(PROJECTIONS)
    kinds = backward_kinds(model)
    loss, grads = loss_and_grads(model)
    assert set(kinds) == {"_LoraLinearBackward"} and len(kinds) == 2 * len(PROJECTIONS)
    torch.testing.assert_close(loss, expected_loss)
    assert grads.keys() == expected.keys() and len(grads) == 4 * len(PROJECTIONS)  # A and B of every layer
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_installing_twice_keeps_one_wrapper():
    model = llama_with_lora()
    assert lean_lora.install(model) == lean_lora.install(model) == 2 * len(PROJECTIONS)
    kinds = backward_kinds(model)
    loss_and_grads(model)
    assert set(kinds) == {"_LoraLinearBackward"}


def test_a_biased_base_layer_gets_its_bias_in_the_one_pass_product():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    model = get_peft_model(net, LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param)
    x = torch.randn(4, 7, 6)
    expected = model(x)
    expected_grads = torch.autograd.grad(expected.square().sum(), [p for p in model.parameters() if p.requires_grad])
    assert lean_lora.install(model) == 2
    out = model(x)
    assert type(out.grad_fn).__name__ == "_LoraLinearBackward"
    grads = torch.autograd.grad(out.square().sum(), [p for p in model.parameters() if p.requires_grad])
    torch.testing.assert_close(out, expected)
    for grad, reference in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, reference)


def one_pass_calls(monkeypatch):
    """How many times the one-pass product runs (a list that grows by one per call)."""
    calls = []
    apply = lean_lora._LoraLinear.apply
    monkeypatch.setattr(lean_lora._LoraLinear, "apply", lambda *a: calls.append(1) or apply(*a))
    return calls


def test_peft_forward_is_kept_where_the_one_pass_product_does_not_apply(monkeypatch):
    model = llama_with_lora(dropout=0.1)
    lean_lora.install(model)
    calls = one_pass_calls(monkeypatch)
    every_layer = 2 * len(PROJECTIONS)
    model.train()
    loss_and_grads(model)
    assert not calls, "adapter dropout draws noise on x: peft's forward"
    model.eval()
    loss_and_grads(model)
    assert len(calls) == every_layer, "no dropout in eval mode"
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_and_grads(model)
    assert not calls, "under autocast the products' dtypes are autocast's"
    with model.disable_adapter(), torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5]]))
    assert not calls
    first = model.base_model.model.model.layers[0].self_attn.q_proj
    first.base_layer.weight.requires_grad_(True)
    _, grads = loss_and_grads(model)
    assert len(calls) == every_layer - 1, "a base weight that trains needs its own gradient: peft's forward"
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight" in grads


def test_bf16_weights_under_bf16_autocast_take_the_one_pass_product(monkeypatch):
    # bf16 training on CPU: bf16 weights (fp32 masters in the optimizer), the forward under bf16 autocast,
    # which casts nothing there; the products are bf16 either way.
    model = llama_with_lora().to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss, expected = loss_and_grads(model)
    lean_lora.install(model)
    calls = one_pass_calls(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = loss_and_grads(model)
    assert len(calls) == 2 * len(PROJECTIONS)
    torch.testing.assert_close(loss, expected_loss, rtol=2e-3, atol=0)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        # bf16 rounding in another order: within a tenth of the gradient's size (a wrong scaling is not).
        reference = expected[name].float()
        assert grad.dtype == torch.bfloat16
        assert (grad.float() - reference).abs().max() <= 0.1 * reference.abs().max(), name


def test_merged_adapters_generate_the_same_tokens():
    model = llama_with_lora()
    model.eval()
    prompt = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=5, do_sample=False)
        lean_lora.install(model)
        assert torch.equal(model.generate(prompt, max_new_tokens=5, do_sample=False), expected)
        model.merge_adapter()
        assert torch.equal(model.generate(prompt, max_new_tokens=5, do_sample=False), expected)


def test_remove_gives_peft_forward_back(monkeypatch):
    model = llama_with_lora()
    lean_lora.install(model)
    assert lean_lora.remove(model) == 2 * len(PROJECTIONS)
    calls = one_pass_calls(monkeypatch)
    loss_and_grads(model)
    assert not calls and lean_lora.remove(model) == 0


def test_a_lora_run_trains_with_the_one_pass_product():
    from qatune.speedups import Speedups

    model = llama_with_lora()
    speedups = Speedups("auto", "fp32", "cpu")
    speedups.attach(model, CausalLMObjective(model))
    assert speedups.on("lora_one_pass")
    kinds = backward_kinds(model)
    loss_and_grads(model)
    assert set(kinds) == {"_LoraLinearBackward"}


def test_an_older_peft_whose_layers_lack_what_the_path_reads_keeps_peft_s_forward(monkeypatch):
    import peft

    from qatune.speedups import Speedups

    model = llama_with_lora()
    for layer in lean_lora.layers(model):
        del layer.lora_variant  # as peft before 0.16 builds its layers
    monkeypatch.setattr(peft, "__version__", "0.15.2")
    assert lean_lora.missing_attributes(model) == ["lora_variant"]
    assert lean_lora.install(model) == 0
    speedups = Speedups("auto", "fp32", "cpu")
    speedups.attach(model, CausalLMObjective(model))
    assert speedups.reasons["lora_one_pass"] == ("peft 0.15.2 is older than this path reads (its LoRA layers lack "
                                                 "lora_variant); pip install 'peft>=0.18'")
    assert lean_lora.remove(model) == 0  # no layer was given the one-pass forward


def test_the_lora_extra_asks_for_a_peft_whose_layers_the_path_reads():
    import tomllib

    from tests.conftest import ROOT

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("lora", "test", "bench"):
        (pin,) = [requirement for requirement in extras[extra] if requirement.startswith("peft>=")]
        floor = tuple(int(part) for part in pin.removeprefix("peft>=").split("."))
        assert floor >= (0, 16), (extra, pin)


def test_gpt2_conv1d_layers_take_the_one_pass_product():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn", "c_fc"],
                                             fan_in_fan_out=True, task_type="CAUSAL_LM"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.2)
    expected_loss, expected = loss_and_grads(model)
    assert lean_lora.install(model) == 4
    kinds = backward_kinds(model)
    loss, grads = loss_and_grads(model)
    assert kinds == ["_LoraLinearBackward"] * 4
    torch.testing.assert_close(loss, expected_loss)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
