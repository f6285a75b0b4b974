"""attention_by_width: eager attention for narrow batches, SDPA for wide ones, a run-time choice only."""

import torch

from qatune.config import ScratchModel, load_config
from qatune.model.folder import ModelInfo, save_model
from qatune.model.scratch_tokenizer import train_scratch_tokenizer
from qatune.model.sources import (
    build_scratch,
)
from tests.conftest import ITEM_TEXTS, ROOT


def test_attention_is_picked_per_batch_width_under_bf16_on_cpu(monkeypatch, tmp_path):
    from transformers.models.gpt2 import modeling_gpt2

    from qatune.speedups.attention import EAGER_ATTENTION_MAX_TOKENS, AttentionByWidth, attention_switch

    def fresh():
        torch.manual_seed(0)
        tokenizer = train_scratch_tokenizer("generative", ITEM_TEXTS, 400)
        return build_scratch(ScratchModel(n_layer=1, n_embd=32, n_head=2, n_positions=64), "generative",
                             tokenizer).eval(), tokenizer

    model, tokenizer = fresh()
    model.config._attn_implementation = "eager"
    assert attention_switch(model) == "the model does not run SDPA attention"
    model.config._attn_implementation = "sdpa"
    eager_calls = []
    eager = modeling_gpt2.eager_attention_forward
    monkeypatch.setattr(modeling_gpt2, "eager_attention_forward",
                        lambda *args, **kwargs: eager_calls.append(1) or eager(*args, **kwargs))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    assert eager_calls == []
    switch = attention_switch(model)
    assert isinstance(switch, AttentionByWidth) and model.config._attn_implementation == "sdpa"
    switch.use(EAGER_ATTENTION_MAX_TOKENS)
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-5, rtol=1e-5)
    assert eager_calls == [1]  # the layer read the switch at its forward
    switch.use(EAGER_ATTENTION_MAX_TOKENS + 1)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        model(input_ids=ids)
    assert eager_calls == [1]
    with switch.forced("eager"):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "sdpa"
    # A run-time choice: the saved model does not carry it.
    switch.use(1)
    folder = save_model(tmp_path / "final", model, tokenizer, load_config(ROOT / "configs" / "tiny-gpt2.yaml"),
                        ModelInfo(task="generative", max_length=32))
    assert "eager" not in (folder / "config.json").read_text()
