"""The parts of qatune export --gguf that need no trained run: the chat template and Modelfile written for a prompt,
the pre-tokenizer name, what is refused, the check's line and the command's own errors."""

import jinja2
import pytest
from click.testing import CliRunner

from qatune.cli import cli
from qatune.export.gguf import Check, unsupported
from qatune.export.gguf_prompt import chat_template
from qatune.export.gguf_write import pre_tokenizer
from qatune.model.folder import LoadedModel, ModelInfo
from tests.conftest import chat_tokenizer, tiny_llama


def render(template, messages, **kwargs):
    return jinja2.Environment().from_string(template).render(messages=messages, **kwargs)


def test_chat_template_renders_the_prompt_and_the_training_text():
    template = chat_template("Context: {context}\nQuestion: {question}\nAnswer:", " ", "<|endoftext|>")
    system, user = {"role": "system", "content": "It is {red}."}, {"role": "user", "content": "Which colour?"}
    prompt = "Context: It is {red}.\nQuestion: Which colour?\nAnswer:"
    assert render(template, [system, user], add_generation_prompt=True) == prompt
    assert render(template, [system, user, {"role": "assistant", "content": "red"}]) == prompt + " red<|endoftext|>"
    # Only the last question is asked; an earlier turn's answer is not appended to it.
    earlier = [user, {"role": "assistant", "content": "blue"}, {"role": "user", "content": "And now?"}]
    assert render(template, earlier) == "Context: \nQuestion: And now?\nAnswer:"
    # Braces written {{ }} in a qatune template are literal braces; quotes and newlines pass through.
    assert render(chat_template('Say "{{x}}":\n{question}'), [user]) == 'Say "{x}":\nWhich colour?'


def test_system_messages_are_the_passage_or_nothing():
    """Every system message is the passage, joined by a blank line (a chat client's own system prompt first); a
    prompt without {context} renders the same whatever system messages come with the question."""
    with_context = chat_template("Context: {context}\nQuestion: {question}\nAnswer:")
    client, passage = {"role": "system", "content": "Be brief."}, {"role": "system", "content": "It is red."}
    user = {"role": "user", "content": "Which colour?"}
    assert render(with_context, [client, passage, user]) == (
        "Context: Be brief.\n\nIt is red.\nQuestion: Which colour?\nAnswer:")
    assert render(with_context, [{"role": "developer", "content": "It is red."}, user]) == (
        "Context: It is red.\nQuestion: Which colour?\nAnswer:")
    without = chat_template("Question: {question}\nAnswer:")
    assert {render(without, m) for m in ([user], [client, user], [client, passage, user])} == {
        "Question: Which colour?\nAnswer:"}


def test_a_config_carried_in_a_file_names_its_files_without_their_folders():
    from qatune.model.gguf_file import without_paths

    dumped = {"output_dir": "/home/ann/runs/faq", "model": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                             "gguf_file": None},
              "data": {"train_file": "examples/data/faq.csv", "eval_file": "C:\\Users\\ann\\held out.xlsx",
                       "system_prompt": "/no_think", "prompt_template": "Q: {question}"}}
    assert without_paths(dumped) == {
        "output_dir": "faq", "model": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "gguf_file": None},
        "data": {"train_file": "faq.csv", "eval_file": "held out.xlsx", "system_prompt": "/no_think",
                 "prompt_template": "Q: {question}"}}
    assert without_paths({"model": {"name_or_path": "/home/ann/models/base/"}}) == {"model": {"name_or_path": "base"}}
    assert without_paths({"model": {"name_or_path": "smollm2-135m-instruct"}}) == {
        "model": {"name_or_path": "smollm2-135m-instruct"}}


def test_pre_tokenizer_name():
    assert pre_tokenizer(chat_tokenizer()) == "gpt-2"  # byte-level with GPT-2's own split, as qatune trains them
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["what is item one", "thing two"], trainers.BpeTrainer(special_tokens=["<unk>"]))
    whitespace = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<unk>")
    assert pre_tokenizer(whitespace) is None


def loaded(prompt_template, tokenizer=None, task="generative", seq2seq=False):
    tokenizer = tokenizer or chat_tokenizer()
    return LoadedModel(model=tiny_llama(tokenizer), tokenizer=tokenizer, config=None, folder=None,
                       info=ModelInfo(task=task, max_length=64, prompt_template=prompt_template, seq2seq=seq2seq))


def test_what_cannot_be_written_is_named():
    assert unsupported(loaded("Question: {question}\nAnswer:")) is None
    assert unsupported(loaded("Context: {context}\nQuestion: {question}\nAnswer:")) is None
    grading = unsupported(loaded("Q: {question}\nMarks: {Total Marks}\nA:"))
    assert grading.startswith("its prompt reads the column(s) 'Total Marks' besides the question and the context")
    assert "extractive" in unsupported(loaded("{question}", task="extractive"))
    assert "encoder-decoder model (T5)" in unsupported(loaded("{question}", seq2seq=True))
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={"<unk>": 0, "a": 1}, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    spm = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<unk>")
    assert "llama.cpp has no pre-tokenizer for" in unsupported(loaded("{question}", tokenizer=spm))


def test_check_line_and_verdict():
    check = Check("q8_0", rows=32, rows_from="held-out rows", prompts_identical=32, answer_rows=4,
                  answers_identical=3, positions=6000, next_tokens_agreeing=5820, next_tokens_as_rounded=6000,
                  first_difference=None)
    assert check.line() == ("q8_0: next-token agreement 97.0% at 6,000 positions (100.0% with the run's weights "
                            "rounded to q8_0), 3/4 answers identical")
    assert check.passed() and check.answer_share == 0.75
    assert not Check("q8_0", 32, "", 32, 4, 4, 6000, 5520, 6000, None).passed()  # below q8_0's 93%
    assert not Check("q8_0", 32, "", 32, 4, 4, 6000, 5820, 5990, None).passed()  # not the rounded weights
    assert not Check("q8_0", 32, "", 31, 4, 4, 6000, 5820, 6000, None).passed()  # one prompt differs
    f32 = Check("f32", 32, "", 32, 4, 4, 6000, 6000, 6000, None)
    assert f32.line() == "f32: next-token agreement 100.0% at 6,000 positions, 4/4 answers identical"
    assert f32.passed()


@pytest.mark.parametrize(("args", "message"), [
    ([], "pass one of --merge FOLDER (a transformers folder) or --gguf OUT.gguf"),
    (["--merge", "m", "--gguf", "m.gguf"], "pass one of --merge FOLDER"),
    (["--gguf", "model.bin"], "--gguf model.bin: the file name must end in .gguf"),
    (["--merge", "m", "--data", "x.csv"], "--data and --set go with --gguf"),
])
def test_export_arguments(args, message, tmp_path):
    done = CliRunner().invoke(cli, ["export", str(tmp_path / "run"), *args])
    assert done.exit_code == 1 and message in done.stderr and "Traceback" not in done.stderr


def test_the_commands_defaults_are_the_checks():
    from qatune.export.gguf_check import ANSWER_ROWS, CHECK_ROWS

    defaults = {p.name: p.default for p in cli.commands["export"].params}
    assert (defaults["rows"], defaults["answer_rows"]) == (CHECK_ROWS, ANSWER_ROWS)


def test_export_does_not_overwrite_a_file(tmp_path):
    (tmp_path / "taken.gguf").write_bytes(b"mine")
    done = CliRunner().invoke(cli, ["export", str(tmp_path / "run"), "--gguf", str(tmp_path / "taken.gguf")])
    assert done.exit_code == 1 and "taken.gguf already exists; choose another file name" in done.stderr
    assert (tmp_path / "taken.gguf").read_bytes() == b"mine"
