"""Grounded decoding: the answers a passage allows, token by token; the logits processor in model.generate (greedy
and beam search); a trained run answering with a span of the passage; the setting, and where it is refused."""

import csv
import json

import pytest
import torch

from qatune.config import GenerateConfig
from qatune.data.spans import in_passage
from qatune.errors import ConfigError
from qatune.inference.grounding import GroundedLogits, allowed_answers, ground_scores, grounded
from qatune.kinds import answer_questions
from qatune.model.folder import ModelInfo, load_model_folder
from tests.conftest import chat_tokenizer, cli_ok
from tests.prompt_runs import context_run

STOP = 2  # <|im_end|>, the chat tokenizer's EOS

PASSAGES = ["the Rhine, the Rhine", "on the Rhine", "Ogród Saski w Warszawie — 北京市."]


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer(texts=[*PASSAGES, "the Rhine flows through Ogród Saski"] * 4)


def allowed_texts(tokenizer, passage, prefix="", max_tokens=32, no_answer=None):
    answers = allowed_answers(tokenizer, [passage], prefix, [STOP], max_tokens, no_answer)[0]
    return {tokenizer.decode(list(tokens)) for tokens in answers.answers()}


RHINE = {"the", "the Rhine", "the Rhine,", "the Rhine, the", "the Rhine, the Rhine",
         "Rhine", "Rhine,", "Rhine, the", "Rhine, the Rhine", ",", ", the", ", the Rhine"}


def test_the_allowed_answers_are_every_span_of_the_passage_also_with_its_first_letter_swapped(tokenizer):
    # repeated words: "the Rhine" twice is one answer; the first and the last piece start and end spans
    swapped = {"The", "The Rhine", "The Rhine,", "The Rhine, the", "The Rhine, the Rhine",
               "rhine", "rhine,", "rhine, the", "rhine, the Rhine"}
    assert allowed_texts(tokenizer, PASSAGES[0]) == RHINE | swapped
    # a longest answer of 3 tokens keeps the spans that fit
    short = allowed_texts(tokenizer, PASSAGES[0], max_tokens=3)
    assert short == {t for t in RHINE | swapped if len(tokenizer(t)["input_ids"]) <= 3} and "the" in short


def test_a_span_is_tokenized_as_an_answer_starts_it(tokenizer):
    """" Rhine" inside the passage and "Rhine" at the start of an answer are the same span."""
    answers = allowed_answers(tokenizer, [PASSAGES[1]], "", [STOP], 32)[0]
    alone, inside = tokenizer("Rhine")["input_ids"], tokenizer(" Rhine")["input_ids"]
    assert alone != inside[-len(alone):] or len(inside) != len(alone)  # the tokenizer writes them differently
    assert tuple(alone) in answers.answers() and tuple(inside) not in answers.answers()
    # step by step: the first token of each span, or one token of its first 1 to 8 letters, then only the way on
    words = ("on", "On", "the", "The", "Rhine", "rhine")
    starts = {tokenizer(word[:k])["input_ids"][0] for word in words for k in range(1, len(word))
              if len(tokenizer(word[:k])["input_ids"]) == 1}
    assert set(answers.allowed([])) == {tokenizer(word)["input_ids"][0] for word in words} | starts
    first, rest = tokenizer("R")["input_ids"], tokenizer("hine")["input_ids"]  # "Rhine" begun with "R"
    assert len(first) == 1 and set(answers.allowed(first)) == {rest[0]} and answers.allowed(first + rest) == [STOP]
    assert answers.allowed(alone) == [STOP]
    assert answers.allowed([*alone, STOP]) is None  # the answer has ended
    # an answer prefix (a template ending in "Answer:") puts its space before every span
    spaced = allowed_answers(tokenizer, [PASSAGES[1]], " ", [STOP], 32)[0]
    assert tuple(inside) in spaced.answers() and tuple(alone) not in spaced.answers()


def test_a_passage_of_non_ascii_text(tokenizer):
    found = allowed_texts(tokenizer, PASSAGES[2])
    for text in ("Ogród", "ogród", "Ogród Saski", "Saski w", "W Warszawie", "—", "北京市", "京市", "市.", "京"):
        assert text in found, text
    for text in ("gród", "Saski Warszawie", "Warszaw", "北京市 .", ""):
        assert text not in found, text
    assert all(in_passage(text, PASSAGES[2]) for text in found)


def test_the_no_answer_text_is_always_allowed(tokenizer):
    assert allowed_texts(tokenizer, PASSAGES[1], no_answer="unanswerable") == allowed_texts(
        tokenizer, PASSAGES[1]) | {"unanswerable"}


def test_a_slow_tokenizer_allows_the_same_spans(tokenizer):
    class Slow:
        is_fast = False

        def __call__(self, texts, **kwargs):
            kwargs.pop("return_offsets_mapping", None)
            return tokenizer(texts, **kwargs)

    for passage in PASSAGES:
        fast = allowed_answers(tokenizer, [passage], "", [STOP], 32, "none")[0].answers()
        slow = allowed_answers(Slow(), [passage], "", [STOP], 32, "none")[0].answers()
        assert slow <= fast and {tokenizer.decode(list(a)) for a in slow} == {tokenizer.decode(list(a)) for a in fast}


def test_rows_without_a_passage_are_free_and_the_mask_is_exact():
    scores = torch.zeros(4, 6)
    out = ground_scores(scores.clone(), [[1, 3], None, [5], None])
    expected = torch.full((4, 6), float("-inf"))
    expected[0, [1, 3]] = 0
    expected[1] = 0
    expected[2, 5] = 0
    expected[3] = 0
    assert torch.equal(out, expected)
    assert ground_scores(scores, [None, None, None, None]) is scores


def test_beams_of_a_row_share_its_allowed_answers(tokenizer):
    answers = allowed_answers(tokenizer, [PASSAGES[1], None], "", [STOP], 32)
    ids = torch.tensor([[9, 9]] * 4)  # 2 rows x 2 beams, nothing generated after the 2 prompt columns
    out = GroundedLogits(answers, start=2, beams=2)(ids, torch.zeros(4, len(tokenizer)))
    first = sorted(answers[0].allowed([]))
    for beam in (0, 1):
        assert torch.isfinite(out[beam]).nonzero().flatten().tolist() == first
    assert torch.isfinite(out[2:]).all()


@pytest.mark.parametrize("beams", [1, 3])
def test_greedy_and_beam_search_write_a_span_of_the_passage(scratch_gpt2, beams):
    from transformers import LogitsProcessorList

    model, tokenizer = scratch_gpt2  # untrained: its free answers are anything
    passages = ["thing 7 is item 1.", "Answer: item 12 or thing 84"]
    prompts = tokenizer([f"Context: {p}\nQuestion: what is it?\nAnswer:" for p in passages], return_tensors="pt",
                        padding=True, padding_side="left")
    answers = allowed_answers(tokenizer, passages, " ", [tokenizer.eos_token_id], 8)
    width = prompts["input_ids"].shape[1]

    def generate(processors):
        out = model.generate(**prompts, max_new_tokens=8, num_beams=beams, do_sample=False, logits_processor=processors,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        return [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out.tolist()]

    free = generate(LogitsProcessorList())
    held = generate(LogitsProcessorList([GroundedLogits(answers, width, beams)]))
    assert not all(in_passage(a, p) for a, p in zip(free, passages))
    assert all(a and in_passage(a, p) for a, p in zip(held, passages)), held


@pytest.fixture(scope="module")
def span_run(tmp_path_factory):
    return context_run(tmp_path_factory.mktemp("grounded"), "train.epochs=40", "train.learning_rate=3e-3")


QUESTION, ELSEWHERE = "what is item 3?", "the sky is grey and the sea is blue."


@pytest.mark.slow
def test_a_trained_run_whose_free_answer_leaves_the_passage_answers_with_a_span_of_it(span_run):
    loaded = load_model_folder(span_run)
    assert loaded.info.grounding == {"rows": 8, "spans": 8, "no_answer": None, "no_answer_rows": 0, "auto": True,
                                     "share": 1.0}

    def answer(setting):
        return answer_questions(loaded.model, loaded.tokenizer, loaded.info, [QUESTION], [ELSEWHERE],
                                GenerateConfig(grounded=setting))[0]

    free, held = answer("off"), answer("on")
    assert free and not in_passage(free, ELSEWHERE)
    assert held and in_passage(held, ELSEWHERE)
    assert answer("auto") == held  # its training answers are spans: auto is on
    # where its free answer is a span of the passage, grounding changes nothing
    own = [answer_questions(loaded.model, loaded.tokenizer, loaded.info, [QUESTION], ["item 3 is thing 3."],
                            GenerateConfig(grounded=setting))[0] for setting in ("off", "on")]
    assert in_passage(own[0], "item 3 is thing 3.") and own[0] == own[1]


@pytest.mark.slow
def test_generate_and_eval_take_grounded(span_run, tmp_path):
    def ask(*flags):
        return cli_ok("generate", span_run, QUESTION, "--context", ELSEWHERE, *flags).output.strip()

    assert in_passage(ask(), ELSEWHERE) and in_passage(ask("--grounded", "on"), ELSEWHERE)
    assert not in_passage(ask("--grounded", "off"), ELSEWHERE)
    data = tmp_path / "held.csv"
    data.write_text(f"question,context,answer\n{QUESTION},{ELSEWHERE},grey\nwhat is item 1?,item 1 is thing 1.,"
                    "thing 1\n", encoding="utf-8")
    for flag, on, share in (("off", False, 50.0), ("on", True, 100.0)):
        metrics = json.loads(cli_ok("eval", span_run, "--data", data, "--json", "--grounded", flag).stdout)
        assert (metrics["grounded"], metrics["in_passage"]) == (on, share)
        lines = (span_run / "predictions-held.csv").read_text(encoding="utf-8").splitlines()
        assert lines[0].endswith(",grounded,in_passage")
        assert lines[1].endswith(",true,true" if on else ",false,false")  # the row whose passage is elsewhere
        out = tmp_path / f"answers-{flag}.csv"
        cli_ok("generate", span_run, "--file", data, "--out", out, "--grounded", flag)
        with open(out, encoding="utf-8", newline="") as f:
            first = next(csv.DictReader(f))
        assert in_passage(first["answer"], ELSEWHERE) is on


def test_grounded_on_is_refused_where_there_is_no_passage_to_take():
    closed = ModelInfo(task="generative", max_length=64)
    with pytest.raises(ConfigError, match=r"its prompt has no \{context\}"):
        grounded(closed, GenerateConfig(grounded="on"))
    assert grounded(closed, GenerateConfig()) is False
    grading = ModelInfo(task="generative", max_length=64, prompt_template="{context} {question}",
                        answer_fields={"score": "number"})
    with pytest.raises(ConfigError, match="grading sheet's fields"):
        grounded(grading, GenerateConfig(grounded="on"))
    reading = ModelInfo(task="generative", max_length=64, prompt_template="{context}\n{question}")
    assert grounded(reading, GenerateConfig()) is False  # a run trained before grounding was decided: auto is off
    assert grounded(reading, GenerateConfig(grounded="on")) is True
    assert grounded(ModelInfo(task="extractive", max_length=64), GenerateConfig(grounded="on")) is False
