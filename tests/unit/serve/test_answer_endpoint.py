"""POST /v1/answer, qatune's own JSON answer: the answer as `qatune generate` gives it, and for a grading run
(data.answer_columns) the answer parsed into its columns; the OpenAI-compatible endpoints keep the raw text."""

import asyncio

import pytest

from qatune.inference.generate import run_answer_template
from qatune.kinds import answer_questions
from qatune.model.folder import ModelInfo, load_model_folder
from tests.prompt_runs import train_tiny

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from qatune.serve.batching import Finished
from qatune.serve.replies import Reply
from tests.unit.serve.test_app import error_of, serving

LABELS = ["low", "mid", "high"]
QUESTION = "what is item 4?"


@pytest.fixture(scope="module")
def grading_run(tmp_path_factory):
    """A run that writes "Score: {score}\\nLabel: {label}" (30 epochs: it learns the layout, if not every value)."""
    rows = [[f"what is item {i}?", str(i % 3), LABELS[i % 3]] for i in range(9)]
    return train_tiny(tmp_path_factory.mktemp("serve-grading"), ["question", "score", "label"], rows,
                      "data.answer_columns=[score, label]", "train.epochs=30", "train.learning_rate=3e-3",
                      "train.warmup_steps=0")


@pytest.fixture(scope="module")
def grading(grading_run):
    with serving(grading_run) as client:
        yield client


def test_a_grading_runs_answer_carries_its_parsed_fields(grading_run, grading):
    loaded = load_model_folder(grading_run, device="cpu")
    want = answer_questions(loaded.model, loaded.tokenizer, loaded.info, [QUESTION], None, loaded.config.generate)[0]
    fields = run_answer_template(loaded.info).parse(want)
    assert fields is not None and list(fields) == ["score", "label"] and fields["label"] in LABELS
    response = grading.post("/v1/answer", json={"question": QUESTION})
    assert response.status_code == 200, response.text
    body = response.json()
    assert list(body) == ["model", "answer", "finish_reason", "usage", "parsed", "fields"]
    assert (body["answer"], body["parsed"], body["fields"], body["finish_reason"]) == (want, True, fields, "stop")
    assert body["model"] == grading_run.name and body["usage"]["prompt_tokens"] > 0
    # cut short, the answer has only the start of its first field
    cut = grading.post("/v1/answer", json={"question": QUESTION, "max_tokens": 2}).json()
    assert (cut["parsed"], cut["finish_reason"]) == (False, "length")
    assert cut["fields"] == run_answer_template(loaded.info).parse(cut["answer"]) and len(cut["fields"] or {}) < 2
    assert grading.get("/run").json()["answer_fields"] == {"score": "number", "label": "label"}


def test_chosen_fields_are_the_answers_generate_gives_asked_all_at_once(grading_run, grading):
    """A grading run writes each field chosen among the values training saw (generate.choose_fields): serve's
    batches choose as qatune generate does."""
    from concurrent.futures import ThreadPoolExecutor

    questions = [f"what is item {i}?" for i in range(9)]
    loaded = load_model_folder(grading_run, device="cpu")
    assert loaded.config.generate.choose_fields
    expected = answer_questions(loaded.model, loaded.tokenizer, loaded.info, questions, None, loaded.config.generate)
    with ThreadPoolExecutor(len(questions)) as pool:
        served = list(pool.map(lambda q: grading.post("/v1/answer", json={"question": q}).json(), questions))
    assert [answer["answer"] for answer in served] == expected
    assert all(answer["parsed"] for answer in served)


def test_the_openai_endpoints_of_a_grading_run_keep_the_raw_text(grading):
    answer = grading.post("/v1/answer", json={"question": QUESTION}).json()["answer"]
    chat = grading.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}]}).json()
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": answer}
    assert set(chat) == {"id", "object", "created", "model", "choices", "usage"}
    completion = grading.post("/v1/completions", json={"prompt": QUESTION}).json()
    assert completion["choices"][0]["text"] == answer and set(completion) == set(chat)


def test_a_run_without_answer_fields_answers_without_them(serve_run):
    with serving(serve_run) as client:
        body = client.post("/v1/answer", json={"question": "where did saki live?"}).json()
        chat = client.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "where did saki live?"}]}).json()
        assert list(body) == ["model", "answer", "finish_reason", "usage"]
        assert body["answer"] == chat["choices"][0]["message"]["content"]
        assert client.get("/run").json()["answer_fields"] is None


def test_the_answer_endpoint_refuses_a_stream_and_an_empty_question(grading):
    assert "to stream" in error_of(grading.post("/v1/answer", json={"question": QUESTION, "stream": True}),
                                   "stream", "unsupported_parameter")
    error_of(grading.post("/v1/answer", json={"question": "  "}), "question", "empty_question")
    response = grading.post("/v1/answer", json={"prompt": QUESTION})
    assert response.status_code == 400 and "question" in response.text


def test_the_answer_shape_parses_with_the_runs_template():
    template = run_answer_template(ModelInfo(task="generative", max_length=32,
                                             answer_fields={"score": "number", "label": "label"},
                                             answer_template="Score: {score}\nLabel: {label}"))

    async def answer(text):
        async def events():
            yield Finished(text, "stop", 3, 4)
        return await Reply("run", False, 3, tokenizer=None).answer(events(), template)

    parsed = asyncio.run(answer("Score: 2\nLabel:  high "))
    assert parsed == {"model": "run", "answer": "Score: 2\nLabel:  high ", "finish_reason": "stop",
                      "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
                      "parsed": True, "fields": {"score": "2", "label": "high"}}
    unparsed = asyncio.run(answer("high"))
    assert (unparsed["parsed"], unparsed["fields"]) == (False, None)
