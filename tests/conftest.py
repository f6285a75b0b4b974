import atexit
import importlib.util
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests' models are tiny, and two torch threads that spin-wait for each other on a machine busy with other
# work make them ten times slower (a 9-step run of tiny_config: 10 s with two threads, 0.9 s with one, beside
# other jobs on 2 cores). Set before torch is imported; the CLI processes the tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# GGUF files converted once a session (qatune.model.gguf_cache), never into the user's own cache; a script that a
# test runs in another process keeps the session's.
if "qatune-test-cache-" not in os.environ.get("QATUNE_CACHE_DIR", ""):
    os.environ["QATUNE_CACHE_DIR"] = tempfile.mkdtemp(prefix="qatune-test-cache-")
    atexit.register(shutil.rmtree, os.environ["QATUNE_CACHE_DIR"], ignore_errors=True)

# A shell that starts pytest in the background without job control (a script's `cmd &`, some CI runners) starts it
# with SIGINT ignored, and every process a test starts inherits that: the page's Stop (SIGINT) then does not reach
# them, and each waits out Jobs.shutdown's 30 s before it is killed. qatune ui's server installs its own SIGINT
# handler, so the commands it starts get the default; the tests' processes get it too.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

MUST_RUN = ("distributed", "browser", "external")
"""Markers of the tests CI's machine has everything for (torchrun, Chromium, node, Go, PyPI): with
QATUNE_NO_SKIPS=1 (.ci/run sets it) such a test that skips fails, since a skipped test is a test that did not run."""
BY_FIXTURE = {"browser": "browser", "hf_jinja": "external", "ollama_go": "external"}


def pytest_collection_modifyitems(config, items):
    """The marker a test's fixtures imply (a page driven in Chromium: browser; node's or Go's renderers: external);
    the files that start processes mark themselves distributed."""
    for item in items:
        for fixture, marker in BY_FIXTURE.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config, log):
        """make test runs the suite in a process on every core (pytest-xdist, ``--dist loadgroup``): an end-to-end
        file's tests share what its fixtures trained and started, and some go on from where the one before left a
        page, so a file's tests run in one process, in order; every other test goes to whichever process is free.
        Grouped here, by path: xdist_group marks group nothing under pytest 9.2 (pytest-dev/pytest-xdist#1386)."""
        if config.getvalue("dist") != "loadgroup":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class EndToEndFiles(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                path = nodeid.split("::", 1)[0]
                return path if path.startswith("tests/e2e/") else nodeid

        return EndToEndFiles(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("QATUNE_NO_SKIPS") == "1":
        marked = [name for name in MUST_RUN if item.get_closest_marker(name) is not None]
        if marked:
            reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            report.outcome = "failed"
            report.longrepr = f"a test marked {marked[0]} skipped where it must run (QATUNE_NO_SKIPS=1): {reason}"


ROOT = Path(__file__).resolve().parent.parent
LOCAL = "http://127.0.0.1:8000"
"""The address in-process test clients ask as (qatune serve and ui answer loopback names only)."""
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


def one_epoch_config(tmp_path, rows, *overrides):
    """tiny_config for one epoch without weight decay: what tests of a single update compare exactly."""
    return tiny_config(tmp_path, rows, "train.epochs=1", "train.weight_decay=0.0", *overrides)


MIXED_ROWS = [(f"question number {i}", "yes" if i % 2 else "a much longer answer with many words") for i in range(14)]
"""14 rows whose answers alternate between one word and seven: batches hold unequal numbers of answer tokens."""

SPAN_ROWS = [(f"what colour is thing {i}?", f"thing {i} is {c} and round.", c)
             for i, c in enumerate(["red", "blue", "green", "black", "white"])]
"""Five (question, context, answer) rows whose answer is a word of the context."""

ITEM_TEXTS = [f"Question: what is item {i}?\nAnswer: thing {i * 7}" for i in range(30)]
"""Texts to train a scratch tokenizer on."""


def resume_config(tmp_path, *overrides):
    """A run that exact resume must reproduce: 12 rows, batch 2 with accumulation 2 (3 optimizer steps an epoch),
    3 epochs, a checkpoint every 2 steps, dropout, warmup and a decaying learning rate."""
    rows = [(f"question number {i}", f"answer {i % 5}") for i in range(12)]
    return tiny_config(tmp_path, rows, "model.scratch.dropout=0.1", "train.epochs=3", "train.batch_size=2",
                       "train.gradient_accumulation_steps=2", "train.save_every=2", "train.learning_rate=3e-3",
                       "train.warmup_steps=2", "train.scheduler.gamma=0.5", *overrides)


def speedups_on(caplog) -> list[str]:
    """The speed paths a training run's log line says are on."""
    line = next(m for m in caplog.messages if m.startswith("speedups ("))
    if ": on: " not in line:
        return []
    return line.split(": on: ", 1)[1].split(";", 1)[0].split(", ")


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def serve_run(tmp_path_factory):
    """A tiny causal run that knows the first 40 FAQ answers (for the qatune serve and eval tests; trained once a
    session, 40 epochs)."""
    from tests.serve_runs import train_run

    return train_run("causal", tmp_path_factory.mktemp("serve"))


class CharTokenizer:
    """One token per character; id 0 is EOS (and the pad token unless ``pad_id`` says otherwise)."""

    def __init__(self, pad_id: int = 0, bos: bool = False):
        self.eos_token_id = 0
        self.pad_token_id = pad_id
        self.bos = bos
        self.eos_token = "<eos>"

    def __call__(self, text, add_special_tokens=True, **_):
        if isinstance(text, list):  # a batch, as Hugging Face tokenizers take it
            return {"input_ids": [self(t, add_special_tokens)["input_ids"] for t in text]}
        ids = [ord(c) for c in text]
        if add_special_tokens and self.bos:
            ids = [1, *ids]
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


CHATML_TEMPLATE = (  # SmolLM2-Instruct's chat template, verbatim
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chat_tokenizer(texts=None, vocab_size=400, template=CHATML_TEMPLATE, specials=("<|endoftext|>", "<|im_start|>",
                   "<|im_end|>"), eos="<|im_end|>"):
    """A byte-level BPE tokenizer trained on the fly, with SmolLM2's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = texts or [f"system user assistant Question: what is item {i}? thing {i * 7} helpful AI" for i in range(40)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[1], eos_token=eos,
                                        unk_token=specials[0], pad_token=eos)
    tokenizer.chat_template = template
    return tokenizer


def tiny_llama(tokenizer, seed=0):
    """A one-layer Llama built from config (tied embeddings, grouped-query attention, like SmolLM2)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config)


def interrupt_at(monkeypatch, step):
    """A SIGINT (as from Ctrl-C) once the training loop has taken optimizer step ``step``."""
    from qatune.train import loop as loop_module

    original = loop_module.train_step

    def stepping(loop, window):
        done = original(loop, window)
        if loop.state.step == step:
            os.kill(os.getpid(), signal.SIGINT)
        return done

    monkeypatch.setattr(loop_module, "train_step", stepping)


def notes_then_data_workbook(path, question, answer):
    """An .xlsx whose first sheet ('Notes') holds a note and whose second ('Data') holds one QA row."""
    from openpyxl import Workbook

    book = Workbook()
    book.active.title = "Notes"
    book.active.append(["notes"])
    book.active.append(["made in May"])
    book.create_sheet("Data").append(["question", "answer"])
    book["Data"].append([question, answer])
    book.save(path)
    return path
