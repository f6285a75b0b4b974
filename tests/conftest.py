import os
from pathlib import Path

import pytest

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


class CharTokenizer:
    """One token per character; id 0 is EOS (and the pad token unless ``pad_id`` says otherwise)."""

    def __init__(self, pad_id: int = 0, bos: bool = False):
        self.eos_token_id = 0
        self.pad_token_id = pad_id
        self.bos = bos
        self.eos_token = "<eos>"

    def __call__(self, text, add_special_tokens=True, **_):
        ids = [ord(c) for c in text]
        if add_special_tokens and self.bos:
            ids = [1] + ids
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i > 1)


@pytest.fixture
def char_tokenizer():
    return CharTokenizer()
