"""qatune serve answers with a span of the passage as `qatune generate` does: the run's setting by default, a
request's "grounded" over it, and the run's summary says which."""

import pytest

from qatune.config import GenerateConfig
from qatune.data.spans import in_passage
from qatune.kinds import answer_questions
from qatune.model.folder import load_model_folder
from tests.prompt_runs import context_run

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient

from qatune.serve.app import Settings, create_app
from tests.conftest import LOCAL

QUESTION, ELSEWHERE = "what is item 3?", "the sky is grey and the sea is blue."


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return context_run(tmp_path_factory.mktemp("grounded-serve"))  # 2 epochs: its free answers are anything


@pytest.fixture(scope="module")
def client(run):
    app = create_app(load_model_folder(run, device="cpu"), Settings())
    with TestClient(app, base_url=LOCAL) as client:
        yield client


def generated(run, setting):
    loaded = load_model_folder(run, device="cpu")
    return answer_questions(loaded.model, loaded.tokenizer, loaded.info, [QUESTION], [ELSEWHERE],
                            GenerateConfig(grounded=setting))[0]


def chat(client, **body):
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                         "context": ELSEWHERE, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_a_request_is_grounded_as_the_run_decided_unless_it_says_otherwise(run, client):
    held, free = generated(run, "on"), generated(run, "off")
    assert in_passage(held, ELSEWHERE) and not in_passage(free, ELSEWHERE)
    assert chat(client) == chat(client, grounded="auto") == chat(client, grounded="on") == held
    assert chat(client, grounded="off") == free
    streamed = client.post("/v1/completions", json={"prompt": QUESTION, "context": ELSEWHERE, "stream": True})
    assert held.split()[0] in streamed.text
    answer = client.post("/v1/answer", json={"question": QUESTION, "context": ELSEWHERE, "grounded": "off"}).json()
    assert (answer["answer"], answer["grounded"]) == (free, False)
    summary = client.get("/run").json()["grounding"]
    assert (summary["default"], summary["setting"], summary["training"]["auto"]) == (True, "auto", True)
    bad = client.post("/v1/answer", json={"question": QUESTION, "context": ELSEWHERE, "grounded": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "grounded"
