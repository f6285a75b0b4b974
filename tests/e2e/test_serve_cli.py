"""`qatune serve` as a real process on a loopback port, asked by the real `openai` client; Ctrl-C drains;
the user's mistakes end in one line."""

import socket
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from qatune.cli import cli
from tests.serve_runs import ServerProcess, faq_rows

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

ROW = faq_rows(2)[1]  # where did henry knox die? -> Thomaston


def client_for(server, key="unused"):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_openai_client_completion_chat_and_streaming(server):
    client = client_for(server)
    assert [m.id for m in client.models.list().data] == ["causal"]

    completion = client.completions.create(model="causal", prompt=ROW["question"], max_tokens=16, temperature=0)
    assert completion.choices[0].text == ROW["answer"] and completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens > 0

    chat = client.chat.completions.create(model="causal", messages=[{"role": "user", "content": ROW["question"]}],
                                          temperature=0)
    assert chat.choices[0].message.content == ROW["answer"] and chat.choices[0].message.role == "assistant"

    stream = client.chat.completions.create(model="causal", messages=[{"role": "user", "content": ROW["question"]}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == ROW["answer"] and len(pieces) > 1
    assert chunks[-1].usage.total_tokens == chat.usage.total_tokens

    streamed = client.completions.create(model="causal", prompt=ROW["question"], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == ROW["answer"]


def test_openai_client_sees_errors_as_its_own_exceptions(server):
    client = client_for(server)
    with pytest.raises(openai.NotFoundError) as found:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="causal", prompt="hi", temperature=5)
    assert bad.value.param == "temperature"
    assert client.completions.create(model="causal", prompt="hi", max_tokens=2).choices  # still serving


def test_a_prompt_column_is_sent_by_the_openai_client_as_extra_body_fields(tmp_path):
    from tests.prompt_runs import score_run

    server = ServerProcess(score_run(tmp_path))
    try:
        client = client_for(server)
        question = [{"role": "user", "content": "what is item 1?"}]
        with pytest.raises(openai.BadRequestError) as missing:
            client.chat.completions.create(model="run", messages=question)
        assert missing.value.param == "fields" and "extra_body" in missing.value.message
        assert any("needs the column(s) ['score']" in line for line in server.log)  # said when it started
        answer = client.chat.completions.create(model="run", messages=question, extra_body={"fields": {"score": 1}})
        assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.prompt_tokens > 0
    finally:
        assert server.stop() == 0
    assert "Traceback" not in "".join(server.log)


def test_a_client_that_leaves_mid_stream_frees_its_slot(server):
    import httpx

    body = {"prompt": "tell me a long story", "max_tokens": 100, "temperature": 1.5, "seed": 5, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first event, then hang up
    for _ in range(100):
        if httpx.get(server.url + "/health").json()["in_flight"] == 0:
            break
        time.sleep(0.1)
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "model": "causal", "in_flight": 0,
                                                        "waiting": 0}


def test_ctrl_c_lets_the_request_in_flight_finish_then_exits_0(serve_run):
    # The request waits 1.5 s in the batcher's queue for company: Ctrl-C arrives while it is in flight.
    server = ServerProcess(serve_run, "--api-key", "k3y", "--batch-wait-ms", "1000")
    with pytest.raises(openai.AuthenticationError):
        client_for(server, "wrong").models.list()
    client = client_for(server, "k3y")
    result = {}
    asking = threading.Thread(target=lambda: result.setdefault("answer", client.completions.create(
        model="causal", prompt=ROW["question"], max_tokens=16)))
    asking.start()
    time.sleep(0.5)
    started = time.monotonic()
    assert server.stop() == 0
    asking.join(30)
    assert result["answer"].choices[0].text == ROW["answer"]
    assert time.monotonic() - started < 20
    assert "Traceback" not in "".join(server.log)
    with pytest.raises(openai.APIConnectionError):  # nothing listens any more
        client.models.list()


def serve(*args):
    return CliRunner().invoke(cli, ["serve", *map(str, args)])


def test_mistakes_end_in_one_line(serve_run, tmp_path):
    missing = serve(tmp_path / "nope")
    assert missing.exit_code == 1 and "run directory" in missing.stderr and "not found" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = serve(serve_run, "--port", taken.getsockname()[1])
    assert busy.exit_code == 1 and "already in use" in busy.stderr and "--port" in busy.stderr
    assert "Traceback" not in busy.output + busy.stderr

    assert serve(serve_run, "--port", "70000").exit_code == 2  # click's usage error
    assert serve(serve_run, "--max-batch-size", "0").exit_code == 2
    empty_key = serve(serve_run, "--api-key", " ")
    assert empty_key.exit_code == 1 and "--api-key is empty" in empty_key.stderr


def test_without_the_serve_extra_one_line_says_what_to_install(serve_run, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now raises ImportError
    result = serve(serve_run)
    assert result.exit_code == 1
    assert result.stderr.strip() == ("error: qatune serve needs FastAPI and uvicorn (uvicorn is not installed): "
                                     "pip install 'qatune[serve]'")
