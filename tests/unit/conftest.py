"""Fixtures that tests of several modules share."""

import pytest

from tests.conftest import ITEM_TEXTS


@pytest.fixture(scope="session")
def scratch_gpt2():
    """A one-layer GPT-2 built from scratch with a tokenizer trained on ITEM_TEXTS, untrained, in eval mode."""
    import torch

    from qatune.config import ScratchModel
    from qatune.model.scratch_tokenizer import train_scratch_tokenizer
    from qatune.model.sources import build_scratch

    torch.manual_seed(0)
    tokenizer = train_scratch_tokenizer("generative", ITEM_TEXTS, 400)
    model = build_scratch(ScratchModel(n_layer=1, n_embd=32, n_head=2, n_positions=64), "generative", tokenizer)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory):
    """LoRA adapters trained on a local 'pretrained' folder: (run directory, config)."""
    pytest.importorskip("peft")
    from tests.lora_runs import train_lora_run

    return train_lora_run(tmp_path_factory.mktemp("lora"))
