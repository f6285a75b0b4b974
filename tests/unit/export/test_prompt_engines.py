"""The prompt an exported file carries, rendered by other engines than the one qatune trains with: its chat template
by @huggingface/jinja (node) and by transformers' jinja2, its Modelfile's TEMPLATE by Go's text/template as Ollama
runs it; each byte for byte the prompt qatune renders, for prompts with and without a passage, a chat model's and
plain ones, and text holding quotes, backslashes, line breaks, braces and other scripts. What a chat client's own
system prompt does is part of it."""

import pytest

from qatune.config import Config
from qatune.data.templates import DEFAULT_CONTEXT_USER_MESSAGE, DEFAULT_USER_MESSAGE, PromptTemplate, chat_template
from qatune.export import ExportError
from qatune.export.gguf import unsupported
from qatune.export.gguf_prompt import chat_template as exported_template
from qatune.export.gguf_prompt import jinja_string, modelfile
from qatune.model.folder import LoadedModel, ModelInfo
from tests.conftest import chat_tokenizer, tiny_llama

pytestmark = pytest.mark.slow  # node and go start processes

TRICKY = 'He said "hi" \\ C:\\temp\\ {{ x }} {% if %} {# no #} """ é 中文 🦙\ttab\nline\r\nCRLF'
"""Text a template or a message may hold: quotes, backslashes, Jinja's and Go's delimiters, the Modelfile's
closing quotes, other scripts, a tab, line breaks."""


def prompts():
    """(name, prompt template, end token text): SmolLM2's chat prompt with and without a passage, plain ones."""
    tokenizer = chat_tokenizer()
    with_context = chat_template(tokenizer, DEFAULT_CONTEXT_USER_MESSAGE, system_prompt="")
    own_system = chat_template(tokenizer, DEFAULT_USER_MESSAGE)  # SmolLM2's own system prompt, no passage
    return [("chat, passage", with_context, "<|im_end|>"), ("chat, no passage", own_system, "<|im_end|>"),
            ("plain, passage", PromptTemplate("Context: {context}\nQuestion: {question}\nAnswer:"), "<|endoftext|>"),
            ("plain", PromptTemplate("Question: {question}\nAnswer:"), "<|endoftext|>"),
            ("tricky", PromptTemplate(TRICKY.replace("{", "{{").replace("}", "}}") + "\n{context}|{question}:",
                                      answer_prefix=' "'), "</s>")]


def conversations(passage=f"Warsaw lies on the Vistula. {TRICKY}", question=f"Where? {TRICKY}"):
    """Conversations a chat client may send, and the question and passage each asks with: a chat client's own
    system prompt is the passage too, joined to a later system message by a blank line."""
    client = "You are a helpful assistant."
    return [
        ([{"role": "system", "content": passage}, {"role": "user", "content": question}], question, passage),
        ([{"role": "user", "content": question}], question, ""),
        ([{"role": "system", "content": client}, {"role": "system", "content": passage},
          {"role": "user", "content": question}], question, f"{client}\n\n{passage}"),
        ([{"role": "system", "content": passage}, {"role": "user", "content": "first?"},
          {"role": "assistant", "content": "an answer"}, {"role": "user", "content": question}], question, passage),
    ]


def messages_only(cases):
    return [messages for messages, _, _ in cases]


@pytest.mark.parametrize(("name", "template", "end"), prompts(), ids=[p[0] for p in prompts()])
def test_chat_template_renders_qatunes_prompt_in_every_engine(name, template, end, hf_jinja):
    text = exported_template(template.template, template.answer_prefix, end)
    assert "\n" not in text  # one line: no engine's handling of line breaks around tags can change it
    cases = conversations()
    expected = [template.render(question, passage) for _, question, passage in cases]
    if not template.uses_context:  # a system message changes nothing where the prompt has no passage
        assert len(set(expected)) == 1
    assert hf_jinja(text, messages_only(cases)) == expected
    tokenizer = chat_tokenizer()
    assert [tokenizer.apply_chat_template(m, chat_template=text, tokenize=False, add_generation_prompt=True)
            for m in messages_only(cases)] == expected
    # With the answer after the question: the training text, answer and end token.
    answered = [[*cases[0][0], {"role": "assistant", "content": 'Ogród "Saski"'}]]
    assert hf_jinja(text, answered) == [expected[0] + template.answer_prefix + 'Ogród "Saski"' + end]


@pytest.mark.parametrize(("name", "template", "end"), prompts(), ids=[p[0] for p in prompts()])
def test_modelfile_renders_qatunes_prompt_in_ollama(name, template, end, ollama_go):
    tokenizer = chat_tokenizer()
    loaded = LoadedModel(model=None, tokenizer=tokenizer, config=Config(), folder=None,
                         info=ModelInfo(task="generative", max_length=64, prompt_template=template.template,
                                        answer_prefix=template.answer_prefix))
    text = modelfile(loaded, "x.gguf")
    cases = conversations()
    assert ollama_go(text, messages_only(cases)) == [template.render(q, p) for _, q, p in cases]


def test_jinja_strings_escape_only_what_a_literal_needs():
    assert jinja_string('a "b" \\ é\n\t\r') == '"a \\"b\\" \\\\ é\\n\\t\\r"'
    with pytest.raises(ExportError, match=r"the run's prompt holds the control character\(s\) U\+001B, which a "
                                          r"chat template cannot carry to llama.cpp and other engines .*: "
                                          r"'colour \\x1b\[31m'$"):
        jinja_string("colour \x1b[31m")


def test_a_prompt_with_a_control_character_is_refused_before_anything_is_written():
    tokenizer = chat_tokenizer()
    loaded = LoadedModel(model=tiny_llama(tokenizer), tokenizer=tokenizer, config=None, folder=None,
                         info=ModelInfo(task="generative", max_length=64, prompt_template="Q\x07: {question}\nA:"))
    assert unsupported(loaded) == ("its prompt holds the control character(s) U+0007, which a chat template "
                                   "cannot carry to llama.cpp and other engines (only tabs and line breaks can be "
                                   "written)")
