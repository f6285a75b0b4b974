import pytest
import torch

from qatune.data.generative import CausalCollator, PromptEncoder, choose_max_length, encode_examples
from qatune.data.padding import IGNORE_INDEX, left_pad
from qatune.data.spreadsheet import QARecord
from qatune.data.templates import PromptTemplate
from qatune.errors import DataError
from tests.conftest import CharTokenizer

TEMPLATE = PromptTemplate("Q:{question}\nA:", answer_prefix=" ")


def ids(text):
    return [ord(c) for c in text]


def test_example_is_prompt_then_answer_then_eos(char_tokenizer):
    encoder = PromptEncoder(char_tokenizer, TEMPLATE)
    example = encoder.example(QARecord("hi?", ["yo"], row=7), max_length=64)
    assert example.input_ids == ids("Q:hi?\nA:") + ids(" yo") + [0]
    assert example.prompt_length == len("Q:hi?\nA:")
    assert example.row == 7 and not example.truncated


def test_labels_mask_prompt_and_padding_but_never_the_eos_even_when_pad_is_eos(char_tokenizer):
    encoder = PromptEncoder(char_tokenizer, TEMPLATE)
    short = encoder.example(QARecord("a", ["b"]), 64)      # Q:a\nA: b<eos> -> 6 prompt + 2 answer + eos = 9
    long = encoder.example(QARecord("abcd", ["xy"]), 64)   # 9 prompt + 3 answer + eos = 13
    batch = CausalCollator(pad_token_id=0)([short, long])
    assert batch["input_ids"].shape == (2, 13)              # padded to the batch's longest row only
    assert batch["attention_mask"][0].tolist() == [1] * 9 + [0] * 4
    assert batch["attention_mask"][1].tolist() == [1] * 13
    assert batch["labels"][0].tolist() == [IGNORE_INDEX] * 6 + ids(" b") + [0] + [IGNORE_INDEX] * 4
    assert batch["labels"][1].tolist() == [IGNORE_INDEX] * 9 + ids(" xy") + [0]
    # The EOS (id 0) and the padding (id 0) share an id; only the real EOS is a label.
    assert batch["input_ids"][0, 8] == 0 and batch["labels"][0, 8] == 0
    assert (batch["labels"][0, 9:] == IGNORE_INDEX).all()


@pytest.mark.parametrize(("multiple", "limit", "uncounted", "width"),
                         [(1, None, 1, 13), (4, None, 1, 13), (8, None, 1, 17), (8, 15, 1, 15), (4, None, 0, 16),
                          (8, None, 0, 16), (8, 15, 0, 15)])
def test_a_rounded_width_rounds_the_columns_the_model_computes(char_tokenizer, multiple, limit, uncounted, width):
    # A 13-token row: where the loss leaves the last column out (it predicts nothing), the model computes 12
    # columns, and 12 is what is rounded; never past the model's positions.
    encoder = PromptEncoder(char_tokenizer, TEMPLATE)
    row = encoder.example(QARecord("abcd", ["xy"]), 64)
    batch = CausalCollator(pad_token_id=0, pad_to_multiple_of=multiple, max_width=limit,
                           uncounted_columns=uncounted)([row])
    assert batch["input_ids"].shape == (1, width)
    assert batch["labels"][0].tolist() == [IGNORE_INDEX] * 9 + ids(" xy") + [0] + [IGNORE_INDEX] * (width - 13)


def test_train_on_prompt_labels_everything_but_padding(char_tokenizer):
    encoder = PromptEncoder(char_tokenizer, TEMPLATE)
    example = encoder.example(QARecord("a", ["b"]), 64)
    other = encoder.example(QARecord("abc", ["b"]), 64)
    batch = CausalCollator(pad_token_id=5, train_on_prompt=True)([example, other])
    assert batch["labels"][0].tolist() == example.input_ids + [IGNORE_INDEX] * 2
    assert batch["input_ids"][0, 9:].tolist() == [5, 5]


def test_truncation_cuts_the_question_and_keeps_the_answer(char_tokenizer):
    encoder = PromptEncoder(char_tokenizer, TEMPLATE)
    record = QARecord("a long question here", ["answer"], row=3)
    example = encoder.example(record, max_length=20)
    # 20 = prompt (Q: + kept question + \nA:) + " answer" (7) + eos (1) -> 12 for the prompt, 7 for the question
    assert len(example) == 20
    assert example.input_ids == ids("Q:a long \nA:") + ids(" answer") + [0]
    assert example.truncated and example.prompt_length == 12


def test_rows_whose_answer_cannot_fit_are_dropped_and_counted(char_tokenizer):
    encoder = PromptEncoder(char_tokenizer, TEMPLATE)
    records = [QARecord("q", ["short"], row=2), QARecord("q", ["x" * 30], row=3), QARecord("q" * 30, ["ok"], row=4)]
    examples, stats = encode_examples(encoder, records, max_length=20)
    assert [e.row for e in examples] == [2, 4]
    assert stats.too_long_rows == [3] and stats.truncated_rows == [4]
    assert [encoder.full_length(r) for r in records] == [13, 38, 39]


def test_context_is_cut_before_the_question(char_tokenizer):
    encoder = PromptEncoder(char_tokenizer, PromptTemplate("{context}|{question}:"))
    prompt = encoder.prompt_ids("who?", "a very long passage", budget=10)
    assert prompt == ids("a ve|who?:")


def test_bos_tokenizers_keep_bos_and_prompts_never_end_in_eos():
    tokenizer = CharTokenizer(pad_id=2, bos=True)
    encoder = PromptEncoder(tokenizer, TEMPLATE)
    example = encoder.example(QARecord("a", ["b"]), 64)
    assert example.input_ids[0] == 1 and example.input_ids[-1] == 0
    assert example.prompt_length == 1 + len("Q:a\nA:")


def test_choose_max_length():
    assert choose_max_length([10, 50, 30], "auto", 1024) == 50
    assert choose_max_length([10, 5000], "auto", 1024) == 1024
    assert choose_max_length([10], 64, 1024) == 64
    with pytest.raises(DataError, match="more than the model's 128 positions"):
        choose_max_length([10], 256, 128)


def test_left_pad_for_generation():
    input_ids, mask = left_pad([[5, 6, 7], [8]], pad_token_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_missing_eos_is_refused():
    tokenizer = CharTokenizer()
    tokenizer.eos_token_id = None
    with pytest.raises(DataError, match="no EOS token"):
        PromptEncoder(tokenizer, TEMPLATE)


def test_real_bpe_tokenizer_trained_on_the_fly_keeps_answer_tokens_identical():
    from qatune.model.scratch_tokenizer import train_scratch_tokenizer

    texts = ["Question: who wrote it?\nAnswer: Ada Lovelace"] * 5
    tokenizer = train_scratch_tokenizer("generative", texts, 300)
    encoder = PromptEncoder(tokenizer, PromptTemplate())
    example = encoder.example(QARecord("who wrote it?", ["Ada Lovelace"]), 64)
    whole = tokenizer("Question: who wrote it?\nAnswer: Ada Lovelace")["input_ids"]
    # Separately encoded prompt + answer equal the text encoded at once: no merge across the boundary.
    assert example.input_ids == [*whole, tokenizer.eos_token_id]
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    batch = CausalCollator(tokenizer.pad_token_id)([example])
    assert batch["labels"][0, -1] == tokenizer.eos_token_id
    assert torch.equal(batch["labels"][0, example.prompt_length:], batch["input_ids"][0, example.prompt_length:])


@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_the_collators_count_of_supervised_tokens_is_what_its_labels_train(char_tokenizer, train_on_prompt):
    encoder = PromptEncoder(char_tokenizer, TEMPLATE)
    records = [QARecord("what?", ["yes"], row=2), QARecord("a longer question?", ["a longer answer"], row=3)]
    examples, _ = encode_examples(encoder, records, max_length=64)
    collator = CausalCollator(pad_token_id=0, train_on_prompt=train_on_prompt)
    batch = collator(examples)
    trained = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(dim=1).tolist()
    assert [collator.supervised(e) for e in examples] == trained
    assert batch["n_items"] == sum(trained)
    assert [collator.last_label(e) for e in examples] == [0, 0]       # the EOS ends every answer
