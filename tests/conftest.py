import os
from pathlib import Path

import pytest

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"


TINY_MODEL = ("model.scratch.n_layer=1", "model.scratch.n_embd=32", "model.scratch.n_head=2",
              "model.scratch.vocab_size=300", "train.precision=fp32")
"""fp32 pinned: tests of exact behaviour must not depend on whether this CPU has native bf16."""


def tiny_config(tmp_path, rows, *overrides):
    """Config of a tiny scratch model trained on ``rows`` ((question, answer) or (question, context, answer)
    tuples, written to tmp_path/qa.csv); later overrides win over earlier ones."""
    import csv

    from qatune.config import load_config

    data = tmp_path / "qa.csv"
    with open(data, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["question", "context", "answer"] if rows and len(rows[0]) == 3 else ["question", "answer"])
        writer.writerows(rows)
    return load_config(None, [f"data.train_file={data}", *TINY_MODEL, "train.logging_steps=1", *overrides])


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


def wordpiece_tokenizer(words):
    """A BERT-style fast tokenizer over an explicit vocabulary: token positions are known exactly."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                                   cls_token="[CLS]", mask_token="[MASK]",
                                   model_input_names=["input_ids", "token_type_ids", "attention_mask"])


def cli_ok(*args):
    """Run the CLI in-process and insist on success (the output is in the assertion message)."""
    from click.testing import CliRunner

    from qatune.cli import cli

    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output + result.stderr
    return result
