"""A generative grader's label and number fields chosen from the values training saw: always one of them, the one
the model finds most likely; its text fields generated."""

import warnings

import pytest
import torch

from qatune.config import GenerateConfig
from qatune.data.generative import PromptEncoder
from qatune.data.grading_fields import AnswerTemplate, field_spec
from qatune.data.templates import PromptTemplate
from qatune.inference.field_choice import asked_ids, chooses_fields, write_answers
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
