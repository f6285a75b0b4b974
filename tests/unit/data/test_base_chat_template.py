"""A base model whose tokenizer has no chat template but has its family's turn markers (Gemma 3 270M's GGUF file) is
given its family's chat template: the training prompt is that template's rendering, exactly, with the answer and
<end_of_turn> the only trained tokens; a tokenizer that has a template, or a run with its own prompt, is left as is."""

import pytest

from qatune.config import DataConfig
from qatune.data.generative import IGNORE_INDEX, CausalCollator, PromptEncoder
from qatune.data.spreadsheet import QARecord
from qatune.data.templates import GEMMA_TURNS, base_chat_template, resolve_template
from tests.conftest import chat_tokenizer

GEMMA_SPECIALS = ("<unk>", "<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>")
GEMMA3_INSTRUCT = (  # Gemma 3 instruct's template for text messages (as tests/families.py keeps it)
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set first = '' %}{% endif %}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
TEXTS = [f"user model Question: what is item {i}? thing {i * 7} passage of item {i} is a thing" for i in range(40)]


def base_tokenizer(template=None):
    """A byte-level BPE with Gemma's special tokens and, as the base model's file, no chat template."""
    return chat_tokenizer(TEXTS, template=template, specials=GEMMA_SPECIALS, eos="<eos>")


def data(**settings):
    return DataConfig(train_file="x.csv", **settings)


def test_the_base_template_is_gemma_3_instructs_own_rendering():
    tokenizer = base_tokenizer()
    assert base_chat_template(tokenizer) == GEMMA_TURNS
    ours, theirs = base_tokenizer(GEMMA_TURNS), base_tokenizer(GEMMA3_INSTRUCT)
    for messages in ([{"role": "user", "content": "what is item 3?"}, {"role": "assistant", "content": "thing 21"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what is item 3?"}]):
        for prompt in (False, True):
            assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == \
                theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    # An empty system message adds nothing (Gemma's own would start the user's turn with two line breaks).
    empty = [{"role": "system", "content": ""}, {"role": "user", "content": "q"}]
    assert ours.apply_chat_template(empty, tokenize=False) == "<bos><start_of_turn>user\nq<end_of_turn>\n"
    # Only a tokenizer without a template and with both turn markers gets one.
    assert base_chat_template(base_tokenizer("{{ messages }}")) is None
    assert base_chat_template(chat_tokenizer(template=None)) is None


@pytest.mark.parametrize("setting", ["auto", "chat"])
def test_auto_and_chat_write_it_into_the_tokenizer_and_prompt_in_its_turns(setting):
    tokenizer = base_tokenizer()
    template = resolve_template(data(prompt_template=setting, context_column="passage", system_prompt=""), tokenizer,
                                "gemma3-270m")
    assert tokenizer.chat_template == GEMMA_TURNS  # the run saves this tokenizer: final/ asks as training did
    assert template.template == ("<bos><start_of_turn>user\n{context}\n\nQuestion: {question}<end_of_turn>\n"
                                 "<start_of_turn>model\n")
    assert template.answer_prefix == ""


def test_the_training_example_is_the_templates_rendering_with_the_answer_and_end_of_turn_trained():
    tokenizer = base_tokenizer()
    encoder = PromptEncoder(tokenizer, resolve_template(data(context_column="passage"), tokenizer))
    end_of_turn, eos = tokenizer.convert_tokens_to_ids("<end_of_turn>"), tokenizer.eos_token_id
    assert (encoder.end_id, encoder.stop_ids) == (end_of_turn, sorted({eos, end_of_turn}))
    record = QARecord("what is item 3?", ["thing 21"], context="passage of item 3 is a thing 21", row=0)
    example = encoder.example(record, max_length=512)
    messages = [{"role": "user", "content": "passage of item 3 is a thing 21\n\nQuestion: what is item 3?"},
                {"role": "assistant", "content": "thing 21"}]
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, return_dict=True)["input_ids"]
    whole = tokenizer.apply_chat_template(messages, return_dict=True)["input_ids"]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert example.input_ids + newline == whole  # one BOS, written by the template, and nothing else added
    assert example.input_ids.count(tokenizer.bos_token_id) == 1 and example.input_ids[0] == tokenizer.bos_token_id
    assert example.prompt_length == len(prompt) and example.input_ids[:len(prompt)] == prompt
    answer = tokenizer("thing 21", add_special_tokens=False)["input_ids"]
    assert example.input_ids[len(prompt):] == [*answer, end_of_turn]
    other = encoder.example(QARecord("what is item 12?", ["thing 84"], context="item 12 is thing 84", row=1), 512)
    batch = CausalCollator(tokenizer.pad_token_id)([example, other])
    assert batch["labels"][0].tolist()[:len(example)] == [IGNORE_INDEX] * len(prompt) + answer + [end_of_turn]
    assert tokenizer.decode([t for t in batch["labels"][0].tolist() if t != IGNORE_INDEX]) == "thing 21<end_of_turn>"


def test_a_prompt_of_the_runs_own_leaves_the_tokenizer_without_a_template():
    tokenizer = base_tokenizer()
    template = resolve_template(data(prompt_template="Q: {question}\nA:"), tokenizer)
    assert tokenizer.chat_template is None
    encoder = PromptEncoder(tokenizer, template)
    assert encoder.end_id == tokenizer.eos_token_id  # a plain prompt's answers end with the EOS
