"""A generative grader's label and number fields chosen from the values training saw: always one of them, the one
the model finds most likely; its text fields generated."""

import gc
import re
import warnings
import weakref

import pytest
import torch

from qatune.config import GenerateConfig
from qatune.data.generative import PromptEncoder
from qatune.data.grading_fields import AnswerTemplate, field_spec
from qatune.data.templates import PromptTemplate
from qatune.inference import field_choice
from qatune.inference.field_choice import asked_ids, chooses_fields, read_prompt, write_answers
from qatune.model.folder import ModelInfo

LABELS = ["thing 7", "thing 14", "item 3"]
SCORES = ["0", "7", "14"]
INFO = ModelInfo(task="generative", max_length=64, prompt_template="Question: {question}\nAnswer:",
                 answer_fields={"verdict": "label", "score": "number", "note": "text"},
                 answer_template="Verdict: {verdict}\nScore: {score}\nNote: {note}",
                 field_specs={"verdict": field_spec("label", LABELS).to_json(),
                              "score": field_spec("number", SCORES).to_json(),
                              "note": field_spec("text", []).to_json()})


def prompts(tokenizer, n=3):
    encoder = PromptEncoder(tokenizer, PromptTemplate(INFO.prompt_template, INFO.answer_prefix))
    return [encoder.prompt_ids(f"what is item {i}?") for i in range(n)]


def notes(continued):
    return [" a note" for _ in continued]


def test_every_answer_holds_a_value_training_saw_and_parses(scratch_gpt2):
    model, tokenizer = scratch_gpt2
    generate = GenerateConfig()
    assert chooses_fields(INFO, generate) and not chooses_fields(INFO, GenerateConfig(choose_fields=False))
    with warnings.catch_warnings():  # the key/value cache passed by the name this transformers gives it
        warnings.simplefilter("error", FutureWarning)
        answers = write_answers(model, tokenizer, INFO, prompts(tokenizer), generate, notes)
    template = AnswerTemplate.make(list(INFO.answer_fields), INFO.answer_template)
    for answer in answers:
        parsed = template.parse(answer)
        assert template.complete(parsed)
        assert parsed["verdict"] in LABELS and parsed["score"] in SCORES and parsed["note"] == "a note"


@pytest.mark.parametrize("wanted", ["item 3", "thing 14"])
def test_the_value_the_model_makes_most_likely_is_chosen(scratch_gpt2, wanted):
    model, tokenizer = scratch_gpt2
    encoder = PromptEncoder(tokenizer, PromptTemplate(INFO.prompt_template, INFO.answer_prefix))
    ids = {label: set(encoder.answer_ids(f"Verdict: {label}\nScore: ")) for label in LABELS}
    favoured = ids[wanted] - set().union(*(ids[label] for label in LABELS if label != wanted))
    assert favoured  # a token only the wanted label's text has
    bias = torch.zeros(len(tokenizer))
    bias[list(favoured)] = 20.0
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, out: out + bias)
    try:
        answers = write_answers(model, tokenizer, INFO, prompts(tokenizer, 2), GenerateConfig(), notes)
    finally:
        hook.remove()
    assert all(answer.startswith(f"Verdict: {wanted}\nScore: ") for answer in answers)


def test_a_text_field_in_the_middle_ends_where_the_next_fields_text_starts(scratch_gpt2):
    model, tokenizer = scratch_gpt2
    info = ModelInfo(task="generative", max_length=64, prompt_template=INFO.prompt_template,
                     answer_fields={"note": "text", "verdict": "label"}, answer_template="Note: {note}\nVerdict: "
                     "{verdict}", field_specs={"note": field_spec("text", []).to_json(),
                                               "verdict": field_spec("label", LABELS).to_json()})
    answers = write_answers(model, tokenizer, info, prompts(tokenizer, 1), GenerateConfig(),
                            lambda continued: ["fine\nVerdict: whatever the model wrote"])
    assert answers[0].startswith("Note: fine\nVerdict: ") and answers[0].split("Verdict: ")[1] in LABELS


@pytest.mark.parametrize("note", ["thing 7", "a note"])
def test_a_text_field_is_asked_from_the_start_of_a_trained_answers_ids(scratch_gpt2, note):
    """The ids a text field is generated after are where training's ids of the whole answer start: not a lone
    space token ('Ġ') after 'Note:' where training joins the space to the note's first word ('Ġthing'); 'Note:' also
    where it does not ('Ġ', 'a'), since the model then writes that space itself."""
    model, tokenizer = scratch_gpt2
    encoder = PromptEncoder(tokenizer, PromptTemplate(INFO.prompt_template, INFO.answer_prefix))
    asked = []

    def written(continued):
        asked.extend(continued)
        return [note] * len(continued)

    given = prompts(tokenizer, 2)
    answers = write_answers(model, tokenizer, INFO, given, GenerateConfig(), written)
    for prompt, ids, answer in zip(given, asked, answers):
        assert answer.endswith(f"\nNote: {note}")
        trained = prompt + encoder.answer_ids(answer)
        assert ids == trained[: len(ids)]
        assert ids == prompt + encoder.answer_ids(answer[: -len(note) - 1])[:-1]  # up to 'Note:', nothing cut before


def test_a_tokenizer_that_keeps_the_space_apart_asks_after_it(char_tokenizer):
    """One token a character: no value changes the space's id, so the whole answer so far is asked from."""
    encoder = PromptEncoder(char_tokenizer, PromptTemplate(INFO.prompt_template, INFO.answer_prefix))
    assert asked_ids(encoder, "Note: ") == encoder.answer_ids("Note: ")[:-1]


def test_rows_go_through_every_field_a_group_at_a_time_and_come_back_in_order(scratch_gpt2, monkeypatch):
    """The keys and values of a group's prompts are let go before the next group is read, so a sheet's rows do not
    pile them up; each answer is its own row's, whatever order the groups took them in."""
    model, tokenizer = scratch_gpt2
    encoder = PromptEncoder(tokenizer, PromptTemplate(INFO.prompt_template, INFO.answer_prefix))
    given = [encoder.prompt_ids(f"what is item {i}?" + " thing" * (7 - i)) for i in range(7)]  # longest first
    held = []

    def reading(*args):
        read = read_prompt(*args)
        held.append(weakref.ref(read[0]))
        return read
    monkeypatch.setattr(field_choice, "read_prompt", reading)
    groups = []

    def numbered(continued):
        gc.collect()
        groups.append((len(continued), sum(ref() is not None for ref in held)))
        return [re.search(r"item (\d+)", tokenizer.decode(ids)).group(1) for ids in continued]

    answers = write_answers(model, tokenizer, INFO, given, GenerateConfig(), numbered, group=3)
    assert groups == [(3, 3), (3, 3), (1, 1)]  # rows, and prompts held, when each group's notes are written
    assert [answer.rsplit("Note: ", 1)[1] for answer in answers] == [str(i) for i in range(7)]
    assert write_answers(model, tokenizer, INFO, given, GenerateConfig(), numbered, group=100) == answers


def test_a_prompt_is_read_for_the_log_probabilities_of_its_last_position_only(scratch_gpt2):
    """The same log-probabilities of the first answer token as the whole prompt's logits give, without computing
    logits for every other position of the prompt."""
    model, tokenizer = scratch_gpt2
    prompt = prompts(tokenizer, 1)[0]
    shapes = []
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, out: shapes.append(out.shape))
    try:
        _, first = read_prompt(model, prompt, torch.device("cpu"), "fp32")
    finally:
        hook.remove()
    assert shapes == [torch.Size([1, 1, len(tokenizer)])] and len(prompt) > 1
    with torch.no_grad():
        whole = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
    torch.testing.assert_close(first, whole)
