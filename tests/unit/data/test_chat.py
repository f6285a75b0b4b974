"""Chat templates and prompts that name any column, on a tokenizer trained in the test (SmolLM2's specials
and chat template): exact token positions, labels and rendering."""

import pytest

from qatune.config import DataConfig
from qatune.data.generative import IGNORE_INDEX, CausalCollator, PromptEncoder
from qatune.data.spreadsheet import QARecord
from qatune.data.templates import PromptTemplate, resolve_template
from qatune.errors import ConfigError, DataError
from tests.conftest import chat_tokenizer

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def data(**settings):
    return DataConfig(train_file="x.csv", **settings)


def test_auto_is_the_chat_template_rendered_once_around_the_placeholders(tokenizer):
    template = resolve_template(data(), tokenizer)
    assert template.template == SYSTEM + "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    assert template.answer_prefix == ""
    with_context = resolve_template(data(context_column="passage"), tokenizer)
    assert "<|im_start|>user\n{context}\n\nQuestion: {question}<|im_end|>" in with_context.template
    assert resolve_template(data(prompt_template="chat"), tokenizer) == template


def test_markup_a_template_writes_before_every_answer_ends_the_prompt_and_is_not_trained():
    """Qwen3's template writes an empty thinking block before the last answer: it belongs to the prompt (as the
    template's own generation prompt without thinking has it), so the trained tokens are the answer alone."""
    thinking = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
                "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message['content'] + '<|im_end|>\n' }}"
                "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    tokenizer = chat_tokenizer(template=thinking)
    template = resolve_template(data(), tokenizer)
    assert template.template == ("<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
                                 "<think>\n\n</think>\n\n")
    assert template.answer_prefix == ""
    encoder = PromptEncoder(tokenizer, template)
    example = encoder.example(QARecord("what is item 3?", ["thing 21"], row=5), max_length=512)
    trained = example.input_ids[example.prompt_length:]
    assert tokenizer.decode(example.input_ids[:example.prompt_length]).endswith("<think>\n\n</think>\n\n")
    assert tokenizer.decode(trained) == "thing 21<|im_end|>"


def test_auto_without_a_chat_template_is_the_plain_template():
    plain = chat_tokenizer(template=None)
    assert resolve_template(data(), plain) == PromptTemplate("Question: {question}\nAnswer:", " ")
    assert resolve_template(data(context_column="c"), None).template == (
        "Context: {context}\nQuestion: {question}\nAnswer:")
    with pytest.raises(ConfigError, match=r"data\.prompt_template: chat, but the tokenizer of m has no chat template"):
        resolve_template(data(prompt_template="chat"), plain, "m")


def test_chat_example_is_the_chat_rendering_with_labels_on_the_answer_and_end_of_turn_only(tokenizer):
    encoder = PromptEncoder(tokenizer, resolve_template(data(), tokenizer))
    example = encoder.example(QARecord("what is item 3?", ["thing 21"], row=5), max_length=512)
    # The same tokens as transformers' own rendering of the conversation (which adds "\n" after the turn).
    messages = [{"role": "user", "content": "what is item 3?"}, {"role": "assistant", "content": "thing 21"}]
    reference = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert example.input_ids + newline == reference
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=True, add_generation_prompt=True,
                                           return_dict=True)["input_ids"]
    assert example.prompt_length == len(prompt) and example.input_ids[: len(prompt)] == prompt
    answer = tokenizer("thing 21", add_special_tokens=False)["input_ids"]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert example.input_ids[len(prompt):] == [*answer, im_end]

    other = encoder.example(QARecord("what is item 12 or item 13?", ["thing 84"]), max_length=512)
    batch = CausalCollator(tokenizer.pad_token_id)([example, other])
    n, width = len(example), len(other)
    assert batch["labels"][0].tolist() == ([IGNORE_INDEX] * len(prompt) + answer + [im_end]
                                           + [IGNORE_INDEX] * (width - n))
    assert batch["attention_mask"][0].tolist() == [1] * n + [0] * (width - n)
    # The end-of-turn token is the EOS and the pad token here: trained once, after the answer, never as padding.
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == im_end
    assert (batch["labels"][0] == im_end).sum() == 1
    assert batch["n_items"] == (len(answer) + 1) + (len(other) - other.prompt_length)


def test_system_prompt_replaces_the_default_and_braces_in_it_stay_literal(tokenizer):
    empty = resolve_template(data(system_prompt=""), tokenizer)
    assert empty.template.startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n{question}")
    braces = resolve_template(data(system_prompt="Answer {briefly}."), tokenizer)
    assert braces.render("q?").startswith("<|im_start|>system\nAnswer {briefly}.<|im_end|>")
    assert braces.fields == []


def test_a_chat_template_whose_turn_ends_with_another_token_than_eos():
    template = ("{% for m in messages %}<|turn|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|turn|>assistant\n{% endif %}")
    tokenizer = chat_tokenizer(template=template, specials=("</s>", "<|turn|>", "<|end|>"), eos="</s>")
    encoder = PromptEncoder(tokenizer, resolve_template(data(), tokenizer))
    end, eos = tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.eos_token_id
    assert encoder.end_id == end != eos
    assert encoder.stop_ids == sorted([end, eos])
    example = encoder.example(QARecord("what is item 3?", ["thing 21"]), max_length=512)
    assert example.input_ids[-1] == end
    labels = CausalCollator(tokenizer.pad_token_id)([example])["labels"][0].tolist()
    assert labels[-1] == end and labels[example.prompt_length - 1] == IGNORE_INDEX
    # A plain template on the same tokenizer writes no special tokens: its answers end with the EOS.
    plain = PromptEncoder(tokenizer, PromptTemplate())
    assert plain.end_id == eos and not plain.writes_special_tokens


def test_chat_truncation_cuts_the_context_and_keeps_the_markup_and_the_answer(tokenizer):
    encoder = PromptEncoder(tokenizer, resolve_template(data(context_column="c", system_prompt=""), tokenizer))
    record = QARecord("what is item 3?", ["thing 21"], context="item 3 is thing 21. " * 40, row=9)
    full = encoder.full_length(record)
    example = encoder.example(record, max_length=full - 30)
    assert example.truncated and len(example) <= full - 30
    text = tokenizer.decode(example.input_ids)
    assert text.startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user\nitem 3 is thing 21.")
    assert text.endswith("\n\nQuestion: what is item 3?<|im_end|>\n<|im_start|>assistant\nthing 21<|im_end|>")


def test_a_template_may_name_any_column(tokenizer):
    template = resolve_template(data(prompt_template="Marks: {Total Marks}\nAnswer: {Coding}\nFeedback:",
                                     question_column="Coding", answer_column="Feedback"), tokenizer)
    # The question column is written as {question} (truncation cuts it); the other one stays a column.
    assert template.template == "Marks: {Total Marks}\nAnswer: {question}\nFeedback:"
    assert template.fields == ["Total Marks"]
    record = QARecord("uses a loop", ["Good."], fields={"Total Marks": "3"})
    assert template.render(record.question, fields=record.fields) == "Marks: 3\nAnswer: uses a loop\nFeedback:"
    encoder = PromptEncoder(tokenizer, template)
    example = encoder.example(record, max_length=128)
    assert tokenizer.decode(example.input_ids[: example.prompt_length]) == "Marks: 3\nAnswer: uses a loop\nFeedback:"
    with pytest.raises(DataError, match=r"the prompt needs the column 'Total Marks' besides the question"):
        encoder.prompt_ids("uses a loop")


def test_any_column_in_the_chat_user_message(tokenizer):
    template = resolve_template(data(user_template="Marks: {Total Marks}\n{question}", system_prompt=""), tokenizer)
    assert template.fields == ["Total Marks"]
    assert template.render("q?", fields={"Total Marks": "2.5"}) == (
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nMarks: 2.5\nq?<|im_end|>\n<|im_start|>assistant\n")
