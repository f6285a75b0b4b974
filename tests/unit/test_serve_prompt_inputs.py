"""qatune serve on runs whose prompt reads more than the question: the columns it names come as "fields", the
passage as "context" (or a system message); what is missing or not used is a 400 saying how to send it."""

import logging
from contextlib import contextmanager

import pytest

from qatune.inference.generate import answer_questions
from qatune.model.folder import load_model_folder
from tests.prompt_runs import context_run, score_run

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient

from qatune.serve.app import Settings, create_app

QUESTION, PASSAGE = "what is item 3?", "item 3 is thing 3."


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prompt-inputs")
    return {"score": score_run(folder / "score"), "context": context_run(folder / "context")}


@contextmanager
def serving(run):
    app = create_app(load_model_folder(run, device="cpu"), Settings())
    with TestClient(app) as client:
        client.service = app.state.service
        yield client


@pytest.fixture(scope="module")
def scored(runs):
    with serving(runs["score"]) as client:
        yield client


@pytest.fixture(scope="module")
def passage(runs):
    with serving(runs["context"]) as client:
        yield client


def expected(run, context=None, fields=None):
    loaded = load_model_folder(run, device="cpu")
    return answer_questions(loaded.model, loaded.tokenizer, loaded.info, [QUESTION], [context],
                            loaded.config.generate, fields=[fields or {}])[0]


def chat(*messages, **body):
    return {"messages": [{"role": role, "content": text} for role, text in messages], **body}


def error_of(response, param, code):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    return error["message"]


def test_the_prompt_columns_come_as_fields_and_answer_as_generate_does(runs, scored):
    want = expected(runs["score"], fields={"score": "1"})
    asked = scored.post("/v1/chat/completions", json=chat(("user", QUESTION), fields={"score": "1"}))
    assert asked.status_code == 200, asked.text
    assert asked.json()["choices"][0]["message"]["content"] == want
    completion = scored.post("/v1/completions", json={"prompt": QUESTION, "fields": {"score": "1"}}).json()
    assert completion["choices"][0]["text"] == want
    tokens = asked.json()["usage"]["prompt_tokens"]
    assert tokens == len(scored.service.encoder.prompt_ids(QUESTION, fields={"score": "1"}))
    # a number is the text a spreadsheet cell of it reads as; a name matches ignoring case, spaces, _ and -
    for fields in ({"score": 1}, {"score": 1.0}, {" Score": "1"}):
        same = scored.post("/v1/completions", json={"prompt": QUESTION, "fields": fields}).json()
        assert same["usage"]["prompt_tokens"] == tokens and same["choices"][0]["text"] == want, fields


def test_a_missing_prompt_column_is_a_400_that_says_how_to_send_it(scored):
    for body in (chat(("user", QUESTION)), chat(("user", QUESTION), fields={}), {"prompt": QUESTION},
                 {"prompt": QUESTION, "fields": {"score": "  "}}):  # blank: in training a blank cell drops its row
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        message = error_of(scored.post(path, json=body), "fields", "missing_fields")
        assert "['score']" in message and '"fields": {"score": "..."}' in message and "extra_body" in message


def test_unknown_or_malformed_fields_are_a_400(scored, passage):
    message = error_of(scored.post("/v1/completions", json={"prompt": QUESTION, "fields": {"score": "1", "x": "2"}}),
                       "fields", "unknown_field")
    assert "['x']" in message and "['score']" in message
    message = error_of(passage.post("/v1/completions", json={"prompt": QUESTION, "context": PASSAGE,
                                                              "fields": {"score": "1"}}), "fields", "unknown_field")
    assert "no column besides the question" in message
    for fields in ('{"score": true}', '{"score": null}', '{"score": [1]}', '["score"]', '"score=1"', '{"score": NaN}'):
        response = scored.post("/v1/completions", content=f'{{"prompt": "{QUESTION}", "fields": {fields}}}',
                               headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "fields", (fields, response.text)


def test_a_prompt_with_a_context_takes_it_from_context_or_the_system_message(runs, passage):
    want = expected(runs["context"], context=PASSAGE)
    by_system = passage.post("/v1/chat/completions", json=chat(("system", PASSAGE), ("user", QUESTION))).json()
    by_field = passage.post("/v1/chat/completions", json=chat(("user", QUESTION), context=PASSAGE)).json()
    by_completion = passage.post("/v1/completions", json={"prompt": QUESTION, "context": PASSAGE}).json()
    assert by_system["choices"][0]["message"]["content"] == by_field["choices"][0]["message"]["content"] == want
    assert by_completion["choices"][0]["text"] == want


def test_a_prompt_with_a_context_refuses_a_request_without_one(passage):
    for path, body in [("/v1/chat/completions", chat(("user", QUESTION))),
                       ("/v1/chat/completions", chat(("system", "  "), ("user", QUESTION))),
                       ("/v1/completions", {"prompt": QUESTION}),
                       ("/v1/completions", {"prompt": QUESTION, "context": ""})]:
        message = error_of(passage.post(path, json=body), "context", "missing_context")
        assert "uses a context" in message and "'context'" in message and "system message" in message


def test_a_prompt_without_a_context_refuses_one_and_ignores_a_system_message(scored):
    fields = {"score": "1"}
    for path, body in [("/v1/completions", {"prompt": QUESTION, "context": PASSAGE, "fields": fields}),
                       ("/v1/chat/completions", chat(("user", QUESTION), context=PASSAGE, fields=fields))]:
        message = error_of(scored.post(path, json=body), "context", "unexpected_context")
        assert "no {context}" in message
    # chat clients send a system message of their own: it is not this run's business
    alone = scored.post("/v1/chat/completions", json=chat(("user", QUESTION), fields=fields)).json()
    with_system = scored.post("/v1/chat/completions", json=chat(("system", "You are helpful."), ("user", QUESTION),
                                                                fields=fields)).json()
    assert with_system["choices"] == alone["choices"] and with_system["usage"] == alone["usage"]


def test_the_summary_and_the_start_log_say_what_a_request_needs(runs, scored, passage):
    assert scored.get("/run").json()["fields"] == ["score"] and scored.get("/run").json()["uses_context"] is False
    assert passage.get("/run").json()["fields"] == [] and passage.get("/run").json()["uses_context"] is True
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("qatune")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        for run in runs.values():
            with serving(run):
                pass
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert any("needs the column(s) ['score']" in line and '"fields": {"score": "..."}' in line for line in lines)
    assert any("reads a context" in line and "'context'" in line for line in lines), lines
