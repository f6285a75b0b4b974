"""qatune ui's routes, in process: every error a request can cause is a 4xx with its message (never a 500), nothing
outside the workspace is reached, and a key guards everything but the page itself."""

import pytest

from tests.conftest import LOCAL, ROOT

fastapi = pytest.importorskip("fastapi")

FAQ = (ROOT / "examples" / "data" / "faq.csv").read_bytes()


@pytest.fixture
def client(tmp_path):
    from fastapi.testclient import TestClient

    from qatune.ui.app import UiSettings, create_app
    from qatune.ui.workspace import Workspace

    app = create_app(Workspace(tmp_path / "ws"), UiSettings(max_upload_bytes=50_000))
    with TestClient(app, base_url=LOCAL) as client:
        yield client


def message(response):
    return response.json()["error"]["message"]


def test_the_page_and_its_files_come_from_qatune(client):
    page = client.get("/")
    assert page.status_code == 200 and '<script src="/static/ui.js"></script>' in page.text
    assert "http" not in page.text.split("<body>")[1]  # nothing loaded from elsewhere
    assert client.get("/static/ui.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/static/ui.css").status_code == 200
    assert client.get("/static/secret.py").status_code == 404
    try_page = client.get("/try/")
    assert "qatune serve" in try_page.text and "'/try' + path" in try_page.text
    assert client.get("/try/v1/models").status_code == 409
    assert message(client.get("/nowhere")) == "no route GET /nowhere"


def test_a_sheet_from_upload_to_config(client):
    described = client.post("/api/sheets?name=faq.csv", content=FAQ).json()
    assert described["guesses"]["question"]["column"] == "question" and described["rows"] == 150
    assert client.get("/api/state").json()["project"]["sheet"] == "faq.csv"
    written = client.post("/api/configs", json={"sheet": "faq.csv", "question": "question", "answers": ["answer"],
                                                "model": "scratch", "run": "faq"}).json()
    assert written["config"] == "configs/faq.yaml"
    assert client.get("/api/files/configs/faq.yaml").text == written["yaml"]
    refused = client.post("/api/train", json={"config": "configs/faq.yaml"})
    assert refused.status_code == 409 and "check configs/faq.yaml first" in message(refused)
    edited = client.put("/api/configs/configs/faq.yaml", json={"yaml": written["yaml"] + "unknown_key: 1\n"})
    assert edited.status_code == 400 and "unknown_key" in message(edited)
    assert message(client.post("/api/configs", json={"sheet": "faq.csv"})).startswith("question: ")


def test_sheets_that_cannot_be_read_give_their_message(client):
    broken = client.post("/api/sheets?name=broken.csv", content=b"question,answer\nwhat?,this,and that\n")
    assert broken.status_code == 400 and "line 2 has 3 cells but the header has 2" in message(broken)
    not_a_workbook = client.post("/api/sheets?name=marks.xlsx", content=b"question,answer\nq,a\n")
    assert not_a_workbook.status_code == 400 and "cannot be opened as an Excel workbook" in message(not_a_workbook)
    damaged = client.post("/api/sheets?name=rows.parquet", content=b"PAR1 not really")
    assert damaged.status_code == 400 and "rows.parquet" in message(damaged)
    assert client.post("/api/sheets?name=notes.txt", content=b"x").status_code == 400
    too_big = client.post("/api/sheets?name=big.csv", content=b"question,answer\n" + b"q,a\n" * 20_000)
    assert too_big.status_code == 413 and "upload limit" in message(too_big)


def test_nothing_outside_the_workspace(client, tmp_path):
    (tmp_path / "secret.csv").write_text("question,answer\nwho knows?,the secret\n", encoding="utf-8")
    for path in ("/api/files/..%2Fsecret.csv", "/api/sheets/..%2F..%2Fsecret.csv", "/api/runs/..%2F..%2F/progress"):
        response = client.get(path)
        assert response.status_code in (400, 404) and "the secret" not in response.text
    client.post("/api/sheets?name=faq.csv", content=FAQ)
    assert client.get("/api/files/.qatune-ui/x.log").status_code == 404
    missing = client.get("/api/runs/faq/final.zip")
    assert missing.status_code == 404 and "no run 'runs/faq'" in message(missing)
    assert client.post("/api/runs/faq/open").status_code == 404
    (tmp_path / "ws" / "runs" / "older").mkdir(parents=True)
    assert client.post("/api/runs/older/open").json() == {"run": "runs/older"}
    assert client.get("/api/state").json()["project"]["run"] == "runs/older"


def test_a_request_body_over_the_limit(client):
    response = client.post("/api/configs", content=b"{" + b" " * 1_100_000 + b"}",
                           headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_the_api_key_guards_all_but_the_page(tmp_path):
    from fastapi.testclient import TestClient

    from qatune.ui.app import UiSettings, create_app
    from qatune.ui.workspace import Workspace

    with TestClient(create_app(Workspace(tmp_path), UiSettings(api_key="k3y")), base_url=LOCAL) as client:
        assert client.get("/").status_code == 200 and client.get("/static/ui.js").status_code == 200
        assert client.get("/try/").status_code == 200
        for path in ("/api/state", "/try/v1/models", "/api/files/configs/x.yaml"):
            assert client.get(path).status_code == 401
        assert client.get("/api/state", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/api/state", headers={"Authorization": "bearer k3y"}).status_code == 200


def test_the_page_never_runs_a_models_own_code(client, tmp_path):
    """A config asking for model.trust_remote_code is the command line's: refused when the page writes it, when it
    saves an edit, when a config put in the workspace by other means is checked or trained, and when a run is
    resumed."""
    client.post("/api/sheets?name=faq.csv", content=FAQ)
    choices = {"sheet": "faq.csv", "question": "question", "answers": ["answer"], "model": "owner/model", "run": "rc"}
    refused = client.post("/api/configs", json={**choices, "trust_remote_code": True})
    assert refused.status_code == 403
    assert message(refused) == ("configs/rc.yaml: model.trust_remote_code is true, which runs the Python code that "
                                "comes with owner/model on this machine; the page never does (any web page could ask "
                                "it to). If you trust that code, run it from the command line: qatune init "
                                "sheets/faq.csv --model owner/model")
    assert not (tmp_path / "ws" / "configs" / "rc.yaml").exists()
    written = client.post("/api/configs", json=choices).json()
    remote = written["yaml"].replace("  name_or_path: owner/model", "  name_or_path: owner/model\n"
                                     "  trust_remote_code: true")
    assert remote != written["yaml"]
    edited = client.put("/api/configs/configs/rc.yaml", json={"yaml": remote})
    assert edited.status_code == 403 and "qatune train --config configs/rc.yaml" in message(edited)
    assert "trust_remote_code" not in (tmp_path / "ws" / "configs" / "rc.yaml").read_text(encoding="utf-8")
    (tmp_path / "ws" / "configs" / "copied.yaml").write_text(remote, encoding="utf-8")
    for step in ("check", "train"):
        response = client.post(f"/api/{step}", json={"config": "configs/copied.yaml"})
        assert response.status_code == 403 and "owner/model" in message(response), step
    run = tmp_path / "ws" / "runs" / "stopped"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(remote + "unknown_key: 1\n", encoding="utf-8")  # even an invalid config
    resumed = client.post("/api/train", json={"resume": "runs/stopped"})
    assert resumed.status_code == 403 and "qatune train --resume runs/stopped" in message(resumed)
    for step, body, command in (("try", {"run": "runs/stopped"}, "qatune serve runs/stopped"),
                                ("compare", {"run": "runs/stopped"}, "qatune eval runs/stopped --compare base"),
                                ("answer", {"run": "runs/stopped", "sheet": "faq.csv"},
                                 "qatune generate runs/stopped --file sheets/faq.csv"),
                                ("export", {"run": "runs/stopped"}, "qatune export runs/stopped --gguf OUT.gguf")):
        response = client.post(f"/api/{step}", json=body)
        assert response.status_code == 403 and message(response).endswith(command), step
    assert client.get("/api/state").json()["jobs"] == {}


def test_an_upload_that_cannot_be_read_is_not_kept_and_the_same_file_again_is_reused(client, tmp_path):
    sheets = tmp_path / "ws" / "sheets"
    broken = client.post("/api/sheets?name=broken.csv", content=b"question,answer\nwhat?,this,and that\n")
    assert broken.status_code == 400 and not list(sheets.iterdir())
    assert client.post("/api/sheets?name=empty.csv", content=b"question,answer\n").status_code == 400
    assert client.post("/api/sheets?name=x.csv&purpose=answer", content=b"\x00\x01binary").status_code == 400
    assert client.get("/api/state").json()["sheets"] == []  # no later list offers them
    first = client.post("/api/sheets?name=faq.csv", content=FAQ).json()
    assert first["upload"] == {"sheet": "faq.csv", "uploaded_as": "faq.csv", "reused": False, "renamed": False}
    again = client.post("/api/sheets?name=faq.csv", content=FAQ).json()
    assert again["upload"]["reused"] and again["sheet"] == "faq.csv"
    other = client.post("/api/sheets?name=faq.csv", content=FAQ.replace(b"Padm", b"Padd")).json()
    assert other["upload"] == {"sheet": "faq-2.csv", "uploaded_as": "faq.csv", "reused": False, "renamed": True}
    assert client.get("/api/state").json()["sheets"] == ["faq-2.csv", "faq.csv"]
    # A sheet put there by other means that cannot be read stays: only what an upload made is removed.
    (sheets / "mine.csv").write_bytes(b"question,answer\nwhat?,this,and that\n")
    assert client.post("/api/sheets?name=mine.csv", content=(sheets / "mine.csv").read_bytes()).status_code == 400
    assert (sheets / "mine.csv").exists()


def test_the_tasks_follow_the_columns_chosen(client):
    with open(ROOT / "tests" / "fixtures" / "xquad_slice.csv", "rb") as f:
        rows = b"".join(f.readlines()[:8])  # under the test client's upload limit
    described = client.post("/api/sheets?name=rc.csv", content=rows).json()
    assert described["guesses"]["context"]["column"] == "context"
    assert [t["value"] for t in described["tasks"]["tasks"]] == ["generative", "extractive"]
    alone = client.get("/api/sheets/rc.csv/tasks?question=question&answer=answer&context=").json()
    assert [t["value"] for t in alone["tasks"]] == ["generative"]
    both = client.get("/api/sheets/rc.csv/tasks?question=question&answer=answer&context=context").json()
    assert both["share"] == 1.0 and len(both["tasks"]) == 2
    missing = client.get("/api/sheets/rc.csv/tasks?question=question&answer=nope&context=context")
    assert missing.status_code == 400 and "nope" in message(missing)
    assert client.get("/api/sheets/rc.csv?delimiter=%3A").status_code == 400


def test_the_state_says_whether_training_can_start_and_why_not(client):
    client.post("/api/sheets?name=faq.csv", content=FAQ)
    client.post("/api/configs", json={"sheet": "faq.csv", "question": "question", "answers": ["answer"],
                                      "model": "scratch", "run": "faq", "held_out": 0})
    state = client.get("/api/state").json()
    assert state["trainable"] == {"config": "configs/faq.yaml", "ok": False,
                                  "why": "check configs/faq.yaml first: the Check step runs qatune check on it (it has "
                                         "not been checked)"}
    assert state["training"] is None and state["project"]["written"]["notes"][0].startswith("nothing is held out")
    other = client.get("/api/state?config=configs/other.yaml").json()["trainable"]
    assert other["ok"] is False and "no config 'configs/other.yaml'" in other["why"]
    refused = client.post("/api/compare", json={"run": "runs/faq"})
    assert refused.status_code == 404  # not trained: no run directory
    (client.app.state.workspace.root / "runs" / "faq").mkdir(parents=True)
    (client.app.state.workspace.root / "runs" / "faq" / "config.yaml").write_text(
        (client.app.state.workspace.root / "configs" / "faq.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    no_base = client.post("/api/compare", json={"run": "runs/faq"})
    assert no_base.status_code == 409 and "a model from scratch knew nothing before training" in message(no_base)
    assert message(client.get("/api/runs/faq/final.zip?dtype=fp16")) == "dtype 'fp16': choose bf16 or fp32"
    assert client.get("/api/runs/faq/final.zip").status_code == 404
    assert not list((client.app.state.workspace.root / ".qatune-ui").iterdir())  # no zip folder left behind
