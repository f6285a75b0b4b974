"""qatune serve's API in-process (FastAPI's TestClient) on tiny trained runs of every kind: answers as
`qatune generate` gives them, streaming, batching, and a 4xx in the OpenAI error shape for every bad request.
And runs whose prompt reads more than the question: the columns it names come as "fields", the passage as
"context" (or a system message); what is missing or not used is a 400 saying how to send it."""

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from qatune.kinds import answer_questions
from qatune.model.folder import load_model_folder
from tests.prompt_runs import context_run, score_run
from tests.serve_runs import faq_rows, train_run, xquad_rows

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient

from qatune.serve.app import Limits, Settings, create_app
from tests.conftest import LOCAL


@pytest.fixture(scope="module")
def runs(serve_run, tmp_path_factory):
    pytest.importorskip("peft")
    folder = tmp_path_factory.mktemp("serve")
    return {"causal": serve_run, **{kind: train_run(kind, folder) for kind in ("seq2seq", "lora", "extractive")}}


@contextmanager
def serving(run, **settings):
    app = create_app(load_model_folder(run, device="cpu"), Settings(**settings))
    with TestClient(app, base_url=LOCAL) as client:
        client.service = app.state.service
        yield client


@pytest.fixture(scope="module")
def fresh_run(tmp_path_factory):
    """A causal run of the shape of runs["causal"] (its tokenizer, its positions) trained for one epoch: for what does
    not depend on what a model has learnt (errors, limits, the API key)."""
    return train_run("causal", tmp_path_factory.mktemp("serve-fresh"), epochs=1)


@pytest.fixture(scope="module")
def fresh(fresh_run):
    with serving(fresh_run, limits=Limits(max_body_bytes=4096, max_prompt_tokens=100, max_tokens=50)) as client:
        yield client


@pytest.fixture(scope="module")
def causal(runs):
    with serving(runs["causal"], limits=Limits(max_body_bytes=4096, max_prompt_tokens=100, max_tokens=50)) as client:
        yield client


def assert_error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and body["error"]["type"]
    assert "Traceback" not in response.text
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def sse(response):
    """The JSON events of a server-sent event stream, and whether it ended with [DONE]."""
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def chat(question, **fields):
    return {"messages": [{"role": "user", "content": question}], **fields}


QUESTIONS = [row["question"] for row in faq_rows(6)]


@pytest.mark.slow
def test_models_health_summary_page_and_loss_curve(causal):
    models = causal.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["causal"]
    assert causal.get("/v1/models/causal").json()["owned_by"] == "qatune"
    assert causal.get("/health").json()["status"] == "ok"
    summary = causal.get("/run").json()
    assert summary["task"] == "generative" and summary["kind"] == "causal" and summary["status"] == "complete"
    assert "GPT2LMHeadModel from scratch" in summary["base_model"] and summary["final_train_loss"] < 1
    assert summary["prompt_template"] == "Question: {question}\nAnswer:" and summary["uses_context"] is False
    page = causal.get("/")
    assert page.headers["content-type"].startswith("text/html") and "<title>qatune serve</title>" in page.text
    curve = causal.get(summary["loss_curve"])
    assert curve.headers["content-type"] == "image/png" and curve.content[:4] == b"\x89PNG"


def test_the_summary_shows_only_evaluations_of_the_served_model(fresh_run, fresh):
    from qatune.runs.atomic import folder_id

    run = fresh_run
    written = {"current": {"f1": 50.0, "model_id": folder_id(run / "final")},
               "before-resume": {"f1": 10.0, "model_id": "0123456789abcdef"},
               "older-qatune": {"f1": 20.0}}
    try:
        for name, metrics in written.items():
            (run / f"eval-{name}.json").write_text(json.dumps(metrics))
        summary = fresh.get("/run").json()
        assert sorted(summary["evaluations"]) == ["current", "older-qatune"]
        # the page labels them as the metric records do
        assert [(c["name"], c["label"], c["digits"]) for c in summary["metric_columns"]] == [
            ("exact_match", "exact match", 1), ("f1", "F1", 1), ("loss", "loss", 3), ("perplexity", "perplexity", 2)]
    finally:
        for name in written:
            (run / f"eval-{name}.json").unlink()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["causal", "seq2seq", "lora"])
def test_generative_runs_answer_as_qatune_generate_does(runs, kind):
    loaded = load_model_folder(runs[kind], device="cpu")
    expected = answer_questions(loaded.model, loaded.tokenizer, loaded.info, QUESTIONS, batch_size=1)
    with serving(runs[kind]) as client:
        completions = [client.post("/v1/completions", json={"prompt": q, "temperature": 0}).json() for q in QUESTIONS]
        chats = [client.post("/v1/chat/completions", json=chat(q, model=kind)).json() for q in QUESTIONS]
        encoder = client.service.encoder
    assert [c["choices"][0]["text"] for c in completions] == expected
    assert [c["choices"][0]["message"]["content"] for c in chats] == expected
    if kind != "lora":  # adapters trained for 3 epochs have not learnt the answers; the others have
        assert expected == [row["answer"] for row in faq_rows(6)]
    first = chats[0]
    assert first["object"] == "chat.completion" and first["model"] == kind and first["id"].startswith("chatcmpl-")
    assert first["choices"][0]["message"]["role"] == "assistant" and first["choices"][0]["finish_reason"] == "stop"
    usage = first["usage"]
    assert usage["prompt_tokens"] == len(encoder.prompt_ids(QUESTIONS[0]))  # the run's template, as in training
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > usage["prompt_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_chunks_add_up_to_the_answer(causal, endpoint):
    question = QUESTIONS[1]
    path, body = ("/v1/chat/completions", chat(question)) if endpoint == "chat" else \
        ("/v1/completions", {"prompt": question})
    whole = causal.post(path, json=body).json()
    streamed = causal.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse(streamed)
    choices = [e["choices"][0] for e in events if e["choices"]]
    if endpoint == "chat":
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["delta"].get("content", "") for c in choices)
        assert text == whole["choices"][0]["message"]["content"] == "Thomaston"
        assert {e["object"] for e in events} == {"chat.completion.chunk"}
    else:
        text = "".join(c["text"] for c in choices)
        assert text == whole["choices"][0]["text"] == "Thomaston"
    assert len([c for c in choices if c.get("delta", c.get("text"))]) > 1  # several pieces, not one at the end
    assert [c["finish_reason"] for c in choices][-1] == "stop"
    assert all(c["finish_reason"] is None for c in choices[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    assert len({e["id"] for e in events}) == 1


@pytest.mark.slow
def test_stop_strings_max_tokens_and_sampling(causal):
    question = QUESTIONS[1]  # answer: Thomaston
    stopped = causal.post("/v1/completions", json={"prompt": question, "stop": ["ton", "zzz"]}).json()
    assert stopped["choices"][0]["text"] == "Thomas" and stopped["choices"][0]["finish_reason"] == "stop"
    streamed = sse(causal.post("/v1/completions", json={"prompt": question, "stop": "ton", "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in streamed) == "Thomas"
    short = causal.post("/v1/completions", json={"prompt": question, "max_tokens": 1}).json()
    assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 1
    seeded = [causal.post("/v1/completions", json={"prompt": "tell me", "temperature": 1.5, "seed": 3,
                                                   "max_tokens": 12}).json()["choices"][0]["text"] for _ in range(2)]
    assert seeded[0] == seeded[1]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["causal", "seq2seq"])
def test_batched_answers_equal_alone_answers_at_temperature_0(runs, kind):
    questions = [*QUESTIONS, "who?", "what is the name of the longest river in the whole wide world?"]

    def ask_all(client, concurrently):
        def ask(q):
            return client.post("/v1/chat/completions", json=chat(q, temperature=0, max_tokens=16)).json()

        if not concurrently:
            return [ask(q)["choices"][0]["message"]["content"] for q in questions]
        with ThreadPoolExecutor(len(questions)) as pool:
            return [r["choices"][0]["message"]["content"] for r in pool.map(ask, questions)]

    with serving(runs[kind], max_batch_size=1) as client:
        alone = ask_all(client, concurrently=False)
        assert client.service.batcher.stats.largest == 1
    with serving(runs[kind], max_batch_size=32, batch_wait_ms=300) as client:
        batched = ask_all(client, concurrently=True)
        stats = client.service.batcher.stats
    assert stats.largest > 2 and stats.batches < len(questions)
    assert batched == alone


@pytest.mark.slow
def test_extractive_run_answers_with_a_span_and_its_score(runs):
    row = xquad_rows()[0]
    loaded = load_model_folder(runs["extractive"], device="cpu")
    expected = answer_questions(loaded.model, loaded.tokenizer, loaded.info, [row["question"]], [row["context"]])[0]
    with serving(runs["extractive"]) as client:
        result = client.post("/v1/extract", json={"question": row["question"], "context": row["context"]}).json()
        assert result["answer"] == expected == row["context"][result["start"] : result["end"]] != ""
        assert isinstance(result["score"], float) and result["usage"]["prompt_tokens"] > 100
        by_chat = client.post("/v1/chat/completions", json={"messages": [
            {"role": "system", "content": row["context"]}, {"role": "user", "content": row["question"]}]}).json()
        assert by_chat["choices"][0]["message"]["content"] == expected
        by_completion = client.post("/v1/completions", json={"prompt": row["question"], "context": row["context"],
                                                             "stream": True})
        assert "".join(e["choices"][0]["text"] for e in sse(by_completion)) == expected
        assert client.get("/run").json()["uses_context"] is True
        assert_error(client.post("/v1/chat/completions", json=chat(row["question"])), 400, "context", "missing_context")
        assert_error(client.post("/v1/extract", json={"question": "x", "context": 5}), 400, "context")
        assert_error(client.post("/v1/extract", json={"question": "x"}), 400, "context", "missing")
        # max_tokens bounds the span as it bounds a generated answer, and the server's limit holds here too
        short = client.post("/v1/completions", json={"prompt": row["question"], "context": row["context"],
                                                     "max_tokens": 1}).json()
        assert short["usage"]["completion_tokens"] == 1 and short["choices"][0]["text"] in row["context"]
        assert_error(client.post("/v1/completions", json={"prompt": row["question"], "context": row["context"],
                                                          "max_tokens": 99999}), 400, "max_tokens",
                     "max_tokens_too_large")


LONG = "where " * 150
BAD_REQUESTS = {
    # name: (method, path, request keyword arguments, status, param, code)
    "malformed JSON": ("POST", "/v1/chat/completions",
                       {"content": b'{"messages": [', "headers": {"content-type": "application/json"}},
                       400, None, "invalid_json"),
    "body is an array": ("POST", "/v1/chat/completions", {"json": [1, 2]}, 400, None, None),
    "empty body": ("POST", "/v1/completions", {"content": b""}, 400, None, None),
    "messages missing": ("POST", "/v1/chat/completions", {"json": {"model": "causal"}}, 400, "messages", "missing"),
    "messages empty": ("POST", "/v1/chat/completions", {"json": {"messages": []}}, 400, "messages", None),
    "messages a string": ("POST", "/v1/chat/completions", {"json": {"messages": "hi"}}, 400, "messages", None),
    "message without role": ("POST", "/v1/chat/completions", {"json": {"messages": [{"content": "hi"}]}},
                             400, "messages.0.role", "missing"),
    "unknown role": ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "wizard", "content": "x"}]}},
                     400, "messages.0.role", None),
    "no user message": ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "system", "content": "x"}]}},
                        400, "messages", None),
    "image content": ("POST", "/v1/chat/completions", {"json": {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}}, 400, None, None),
    "temperature a string": ("POST", "/v1/chat/completions", {"json": chat("x", temperature="hot")},
                             400, "temperature", "float_type"),
    "temperature too high": ("POST", "/v1/chat/completions", {"json": chat("x", temperature=3)}, 400, "temperature",
                             None),
    "top_p zero": ("POST", "/v1/chat/completions", {"json": chat("x", top_p=0)}, 400, "top_p", None),
    "max_tokens zero": ("POST", "/v1/completions", {"json": {"prompt": "x", "max_tokens": 0}}, 400, "max_tokens", None),
    "max_tokens a float": ("POST", "/v1/completions", {"json": {"prompt": "x", "max_tokens": 2.5}}, 400, "max_tokens",
                           None),
    "max_tokens a boolean": ("POST", "/v1/completions", {"json": {"prompt": "x", "max_tokens": True}},
                             400, "max_tokens", "int_type"),
    "max_tokens above the limit": ("POST", "/v1/completions", {"json": {"prompt": "x", "max_tokens": 51}},
                                   400, "max_tokens", "max_tokens_too_large"),
    "stream a string": ("POST", "/v1/completions", {"json": {"prompt": "x", "stream": "yes"}}, 400, "stream", None),
    "five stop strings": ("POST", "/v1/completions", {"json": {"prompt": "x", "stop": list("abcde")}}, 400, "stop",
                          None),
    "seed a string": ("POST", "/v1/completions", {"json": {"prompt": "x", "seed": "1"}}, 400, "seed", None),
    "unknown model": ("POST", "/v1/chat/completions", {"json": chat("x", model="gpt-4")}, 404, "model",
                      "model_not_found"),
    "unknown model listed": ("GET", "/v1/models/gpt-4", {}, 404, "model", "model_not_found"),
    "n above 1": ("POST", "/v1/chat/completions", {"json": chat("x", n=2)}, 400, "n", "unsupported_parameter"),
    "logprobs": ("POST", "/v1/completions", {"json": {"prompt": "x", "logprobs": 5}}, 400, "logprobs",
                 "unsupported_parameter"),
    "empty question": ("POST", "/v1/completions", {"json": {"prompt": "   "}}, 400, "prompt", "empty_question"),
    "prompt a number": ("POST", "/v1/completions", {"json": {"prompt": 42}}, 400, "prompt", None),
    "two prompts": ("POST", "/v1/completions", {"json": {"prompt": ["a", "b"]}}, 400, "prompt", None),
    "prompt too long": ("POST", "/v1/completions", {"json": {"prompt": LONG}}, 400, "prompt",
                        "context_length_exceeded"),
    "prompt far too long to tokenize": ("POST", "/v1/completions", {"json": {"prompt": LONG * 2}}, 400, "prompt",
                                        "context_length_exceeded"),
    # torch's generator takes seeds in [-2**63, 2**64): outside, the request is refused before any batch
    "seed above 64 bits": ("POST", "/v1/completions", {"json": {"prompt": "x", "seed": 2**64}}, 400, "seed", None),
    "seed below 64 bits": ("POST", "/v1/chat/completions", {"json": chat("x", seed=-(2**63) - 1, temperature=1)},
                           400, "seed", None),
    "temperature NaN": ("POST", "/v1/chat/completions", {  # Python's JSON reader takes NaN; it is no temperature
        "content": b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        "headers": {"content-type": "application/json"}}, 400, "temperature", "finite_number"),
    "form-encoded body": ("POST", "/v1/completions", {"content": b"prompt=x", "headers": {
        "content-type": "application/x-www-form-urlencoded"}}, 400, None, None),
    "body too large": ("POST", "/v1/completions", {"json": {"prompt": "x" * 5000}}, 413, None, "request_too_large"),
    "body too large, chunked": ("POST", "/v1/completions", {"content": iter([b'{"prompt": "', b"x" * 5000, b'"}'])},
                                413, None, "request_too_large"),
    "extract on a generative run": ("POST", "/v1/extract", {"json": {"question": "x", "context": "y"}},
                                    400, None, "unsupported_task"),
    "unknown route": ("GET", "/v2/answers", {}, 404, None, "not_found"),
    "wrong method": ("GET", "/v1/chat/completions", {}, 405, None, None),
}


def test_a_form_encoded_body_is_told_to_send_json(fresh):
    error = assert_error(fresh.post("/v1/completions", content=b"prompt=x",
                                     headers={"content-type": "application/x-www-form-urlencoded"}), 400)
    assert error["message"] == "the body must be a JSON object, sent with the header 'Content-Type: application/json'"


def test_seeds_at_the_generators_limits_are_answered(fresh):
    for seed in (2**64 - 1, -(2**63)):
        assert fresh.post("/v1/completions", json={"prompt": QUESTIONS[0], "max_tokens": 2, "temperature": 1,
                                                    "seed": seed}).status_code == 200


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_a_bad_request_gets_a_4xx_in_the_openai_shape_and_the_server_keeps_serving(fresh, name):
    method, path, kwargs, status, param, code = BAD_REQUESTS[name]
    assert_error(fresh.request(method, path, **kwargs), status, param, code)
    assert fresh.post("/v1/completions", json={"prompt": QUESTIONS[0], "max_tokens": 2}).status_code == 200


def test_a_question_is_cut_to_leave_max_tokens_room_in_the_model_positions(fresh):
    encoder, positions = fresh.service.encoder, fresh.service.positions
    question = "where"
    while len(encoder.prompt_ids(question)) < positions - 30:
        question += " where"
    fits = fresh.post("/v1/completions", json={"prompt": question, "max_tokens": 20}).json()
    assert fits["usage"]["prompt_tokens"] == len(encoder.prompt_ids(question))
    cut = fresh.post("/v1/completions", json={"prompt": question, "max_tokens": 40}).json()
    assert cut["usage"]["prompt_tokens"] == len(encoder.prompt_ids(question, None, positions - 40))


def test_a_question_longer_than_the_model_positions_is_cut_as_qatune_generate_cuts_it(fresh_run):
    loaded = load_model_folder(fresh_run, device="cpu")
    question = "where did henry knox die? " + "and where " * 100
    expected = answer_questions(loaded.model, loaded.tokenizer, loaded.info, [question],
                                generate=loaded.config.generate)
    with serving(fresh_run, limits=Limits(max_prompt_tokens=1000)) as client:
        encoder, positions = client.service.encoder, client.service.positions
        assert len(encoder.prompt_ids(question)) > positions
        asked = client.post("/v1/chat/completions", json=chat(question)).json()  # no max_tokens: the run's 32
        assert [asked["choices"][0]["message"]["content"]] == expected
        assert asked["usage"]["prompt_tokens"] == len(encoder.prompt_ids(question, None, positions - 32))
        streamed = sse(client.post("/v1/completions", json={"prompt": question, "max_tokens": 100, "stream": True,
                                                            "stream_options": {"include_usage": True}}))
        assert streamed[-1]["usage"]["prompt_tokens"] == len(encoder.prompt_ids(question, None, positions - 100))
        # A max_tokens that leaves the prompt no room: the 400 names it as the client sent it.
        error = assert_error(client.post("/v1/completions", json={"prompt": question, "max_tokens": 125}), 400,
                             None, "context_length_exceeded")
        assert "max_tokens=125" in error["message"] and f"{positions} positions" in error["message"]
        error = assert_error(client.post("/v1/completions", json={"prompt": question, "max_tokens": positions + 72}),
                             400, None, "context_length_exceeded")
        assert error["message"] == (f"max_tokens={positions + 72} is not less than the model's {positions} "
                                    "positions (the prompt needs some of them); send a lower max_tokens")
        too_long = assert_error(client.post("/v1/completions", json={"prompt": "where " * 1100}), 400,
                                "prompt", "context_length_exceeded")  # --max-prompt-tokens, a server limit
        assert_error(client.post("/v1/chat/completions", json=chat("where " * 1100)), 400, "messages",
                     "context_length_exceeded")
        assert "more than this server allows (1000)" in too_long["message"] and "max_tokens" not in too_long["message"]


def test_too_many_requests_in_flight_get_429(fresh):
    gate = fresh.service.gate
    gate.active = gate.limit  # as if that many requests were being answered
    try:
        busy = fresh.post("/v1/completions", json={"prompt": "x"})
        assert_error(busy, 429, None, "too_many_requests")
        assert busy.headers["retry-after"] == "1"
    finally:
        gate.active = 0
    assert fresh.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert gate.active == 0  # every slot was given back, streamed or not
    sse(fresh.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}))
    assert gate.active == 0


def test_with_an_api_key_every_request_but_the_page_and_the_health_probe_needs_it(fresh_run):
    with serving(fresh_run, api_key="s3cret") as client:
        assert_error(client.get("/v1/models"), 401, None, "invalid_api_key")
        assert_error(client.get("/run"), 401, None, "invalid_api_key")
        assert_error(client.post("/health", json={}), 401, None, "invalid_api_key")  # only the probe is open
        assert client.get("/health").json()["status"] == "ok"  # a load balancer's probe needs no key
        assert client.head("/health").status_code == 200
        assert_error(client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}),
                     401, None, "invalid_api_key")
        assert_error(client.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "s3cret"}),
                     401, None, "invalid_api_key")
        assert client.get("/").status_code == 200  # the page holds nothing; it asks for the key
        good = {"Authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=good).status_code == 200
        assert client.get("/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200  # any case
        assert_error(client.get("/v1/models", headers={"Authorization": "Bearer S3CRET"}), 401, None,
                     "invalid_api_key")
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=good).status_code == 200


# --- runs whose prompt reads more than the question

QUESTION, PASSAGE = "what is item 3?", "item 3 is thing 3."


@pytest.fixture(scope="module")
def field_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prompt-inputs")
    return {"score": score_run(folder / "score"), "context": context_run(folder / "context")}


@pytest.fixture(scope="module")
def scored(field_runs):
    with serving(field_runs["score"]) as client:
        yield client


@pytest.fixture(scope="module")
def passage(field_runs):
    with serving(field_runs["context"]) as client:
        yield client


def expected(run, context=None, fields=None):
    loaded = load_model_folder(run, device="cpu")
    return answer_questions(loaded.model, loaded.tokenizer, loaded.info, [QUESTION], [context],
                            loaded.config.generate, fields=[fields or {}])[0]


def chat_of(*messages, **body):
    return {"messages": [{"role": role, "content": text} for role, text in messages], **body}


def error_of(response, param, code):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    return error["message"]


def test_the_prompt_columns_come_as_fields_and_answer_as_generate_does(field_runs, scored):
    want = expected(field_runs["score"], fields={"score": "1"})
    asked = scored.post("/v1/chat/completions", json=chat_of(("user", QUESTION), fields={"score": "1"}))
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
    for body in (chat_of(("user", QUESTION)), chat_of(("user", QUESTION), fields={}), {"prompt": QUESTION},
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


def test_a_prompt_with_a_context_takes_it_from_context_or_the_system_message(field_runs, passage):
    want = expected(field_runs["context"], context=PASSAGE)
    by_system = passage.post("/v1/chat/completions", json=chat_of(("system", PASSAGE), ("user", QUESTION))).json()
    by_field = passage.post("/v1/chat/completions", json=chat_of(("user", QUESTION), context=PASSAGE)).json()
    by_completion = passage.post("/v1/completions", json={"prompt": QUESTION, "context": PASSAGE}).json()
    assert by_system["choices"][0]["message"]["content"] == by_field["choices"][0]["message"]["content"] == want
    assert by_completion["choices"][0]["text"] == want


def test_a_prompt_with_a_context_refuses_a_request_without_one(passage):
    for path, body in [("/v1/chat/completions", chat_of(("user", QUESTION))),
                       ("/v1/chat/completions", chat_of(("system", "  "), ("user", QUESTION))),
                       ("/v1/completions", {"prompt": QUESTION}),
                       ("/v1/completions", {"prompt": QUESTION, "context": ""})]:
        message = error_of(passage.post(path, json=body), "context", "missing_context")
        assert "uses a context" in message and "'context'" in message and "system message" in message


def test_a_prompt_without_a_context_refuses_one_and_ignores_a_system_message(scored):
    fields = {"score": "1"}
    for path, body in [("/v1/completions", {"prompt": QUESTION, "context": PASSAGE, "fields": fields}),
                       ("/v1/chat/completions", chat_of(("user", QUESTION), context=PASSAGE, fields=fields))]:
        message = error_of(scored.post(path, json=body), "context", "unexpected_context")
        assert "no {context}" in message
    # chat clients send a system message of their own: it is not this run's business
    alone = scored.post("/v1/chat/completions", json=chat_of(("user", QUESTION), fields=fields)).json()
    with_system = scored.post("/v1/chat/completions", json=chat_of(("system", "You are helpful."), ("user", QUESTION),
                                                                   fields=fields)).json()
    assert with_system["choices"] == alone["choices"] and with_system["usage"] == alone["usage"]


def test_the_summary_and_the_start_log_say_what_a_request_needs(field_runs, scored, passage):
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
        for run in field_runs.values():
            with serving(run):
                pass
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert any("needs the column(s) ['score']" in line and '"fields": {"score": "..."}' in line for line in lines)
    assert any("reads a context" in line and "'context'" in line for line in lines), lines


# --- one answer, whichever way it is asked

def answer_cases(kind, runs, field_runs):
    """(run, questions, contexts, fields) of each kind of answer: free (a causal LM, an encoder-decoder, LoRA
    adapters), a span (extractive), held to the passage (grounded), a prompt with a column besides the question."""
    if kind in ("causal", "seq2seq", "lora"):
        return runs[kind], QUESTIONS, [None] * len(QUESTIONS), [{}] * len(QUESTIONS)
    if kind == "extractive":
        rows = xquad_rows()[:6]
        return runs[kind], [r["question"] for r in rows], [r["context"] for r in rows], [{}] * len(rows)
    if kind == "grounded":
        items = range(2, 8)
        return (field_runs["context"], [f"what is item {i}?" for i in items],
                [f"item {i} is thing {i}." for i in items], [{}] * len(items))
    return field_runs["score"], [f"what is item {i}?" for i in range(6)], [None] * 6, [{"score": str(i % 3)}
                                                                                          for i in range(6)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["causal", "seq2seq", "lora", "extractive", "grounded", "fields"])
def test_serve_batched_and_generate_give_the_same_answers_at_temperature_0(runs, field_runs, kind):
    """qatune serve decodes in batches of its own (requests join a running batch); qatune generate through the
    model's generate. At temperature 0 both give every kind of answer alike, asked all at once (batched) on serve."""
    run, questions, contexts, fields = answer_cases(kind, runs, field_runs)
    loaded = load_model_folder(run, device="cpu")
    expected = answer_questions(loaded.model, loaded.tokenizer, loaded.info, questions, contexts,
                                loaded.config.generate, fields=fields)
    with serving(run, max_batch_size=8) as client:
        def ask(i):
            body = {"question": questions[i], **({"context": contexts[i]} if contexts[i] else {}),
                    **({"fields": fields[i]} if fields[i] else {})}
            response = client.post("/v1/answer", json=body)
            assert response.status_code == 200, response.text
            return response.json()["answer"]

        with ThreadPoolExecutor(len(questions)) as pool:
            answers = list(pool.map(ask, range(len(questions))))
        batches = client.service.batcher.stats.batches
    assert answers == expected
    assert kind == "extractive" or batches < len(questions)  # answered together, not one by one
