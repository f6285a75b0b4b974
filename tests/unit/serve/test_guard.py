"""The request guard both servers run (qatune.serve.guard): what a web page open in the user's browser can no longer do
to `qatune serve` or `qatune ui` on 127.0.0.1, and what scripts, the page itself and a proxy still can.

Each test runs against both apps, in process; a request an attacker's page can make is refused before a route runs,
so nothing lands on disk and no job starts."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient

from tests.conftest import LOCAL, ROOT

FAQ = (ROOT / "examples" / "data" / "faq.csv").read_bytes()
EVIL = {"Host": "evil.example:8799", "Origin": "http://evil.example:8799"}
OWN = {"Origin": LOCAL}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(params=["serve", "ui"])
def kind(request):
    return request.param


@pytest.fixture
def server(kind, tmp_path, request):
    """``server(**settings)``: a client of the app of this kind, and what it changes on disk (ui: its workspace)."""
    workspace = tmp_path / "ws"

    @contextmanager
    def start(**settings):
        if kind == "ui":
            from qatune.ui.app import UiSettings, create_app
            from qatune.ui.workspace import Workspace

            (workspace / "sheets").mkdir(parents=True, exist_ok=True)
            (workspace / "sheets" / "faq.csv").write_bytes(FAQ)
            app = create_app(Workspace(workspace), UiSettings(port=8000, **settings))
        else:
            from qatune.model.folder import load_model_folder
            from qatune.serve.app import Settings, create_app

            settings.pop("token", None)
            run = request.getfixturevalue("serve_run")
            app = create_app(load_model_folder(run, device="cpu"), Settings(port=8000, **settings))
        with TestClient(app, base_url=LOCAL, follow_redirects=False) as client:
            yield client

    return start


def reading(kind):
    """A GET that reads what the server holds."""
    return "/api/state" if kind == "ui" else "/v1/models"


def changing(client, kind, headers=None, text_plain=False):
    """A POST that writes or runs something: the ui writes a config or uploads a sheet; serve decodes."""
    if kind == "ui":
        if text_plain:  # a cross-site "simple" request: no preflight
            return client.post("/api/sheets?name=s.csv", content=FAQ, headers={"Content-Type": "text/plain",
                                                                             **(headers or {})})
        return client.post("/api/configs", json={"sheet": "faq.csv", "question": "question", "answers": ["answer"],
                                                 "model": "scratch", "run": "pwn"}, headers=headers)
    if text_plain:
        return client.post("/v1/chat/completions", content=b'{"messages": []}',
                           headers={"Content-Type": "text/plain", **(headers or {})})
    return client.post("/v1/chat/completions", json=CHAT, headers=headers)


def files(tmp_path):
    return sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "ws").rglob("*") if p.is_file())


def test_a_foreign_host_is_refused_before_anything_is_read_or_written(server, kind, tmp_path):
    with server() as client:
        before = files(tmp_path)
        for response in (client.get(reading(kind), headers=EVIL), client.get("/", headers=EVIL),
                         changing(client, kind, EVIL), changing(client, kind, EVIL, text_plain=True)):
            assert response.status_code == 403, response.text
            message = response.json()["error"]["message"]
            assert message.startswith("the Host 'evil.example:8799' is not a name qatune")
            assert "DNS rebinding" in message and "--allowed-host evil.example" in message
        assert files(tmp_path) == before
        assert client.get(reading(kind)).status_code == 200  # 127.0.0.1:8000
        for name in ("localhost:8000", "[::1]:8000", "127.0.0.1", "LOCALHOST."):
            assert client.get(reading(kind), headers={"Host": name}).status_code == 200, name


def test_a_foreign_origin_cannot_change_anything(server, kind, tmp_path):
    with server() as client:
        before = files(tmp_path)
        for origin in ("http://evil.example:8799", "http://localhost:3000", "null", "http://127.0.0.1:9999"):
            for text_plain in (False, True):
                response = changing(client, kind, {"Origin": origin}, text_plain)
                assert response.status_code == 403, (origin, response.text)
                assert response.json()["error"]["code"] == "origin_not_allowed"
                assert f"from '{origin}' is refused" in response.json()["error"]["message"]
        referred = changing(client, kind, {"Referer": "http://evil.example/page.html"})
        assert referred.status_code == 403  # no Origin: the Referer says where the request comes from
        if kind == "ui":
            put = client.put("/api/configs/configs/pwn.yaml", json={"yaml": "task: generative\n"},
                             headers={"Origin": "http://evil.example"})
            assert put.status_code == 403
        assert files(tmp_path) == before
        # the page's own requests, and scripts that send no Origin, pass
        assert changing(client, kind, OWN).status_code == 200
        assert changing(client, kind, {"Referer": f"{LOCAL}/"}).status_code == 200
        assert changing(client, kind).status_code == 200
        assert client.get(reading(kind), headers={"Origin": "http://evil.example"}).status_code == 200  # reads only


def test_an_allowed_host_lets_a_proxy_through(server, kind):
    with server(allowed_hosts=("qatune.example",)) as client:
        proxied = {"Host": "qatune.example", "Origin": "https://qatune.example"}
        assert client.get(reading(kind), headers=proxied).status_code == 200
        assert changing(client, kind, proxied).status_code == 200
        # a proxy that passes its own Host on (127.0.0.1:8000) and the browser's Origin
        assert changing(client, kind, {"Origin": "https://qatune.example"}).status_code == 200
        assert client.get(reading(kind), headers=EVIL).status_code == 403


def test_the_api_key_is_asked_of_every_request_but_the_page(server, kind):
    with server(api_key="k3y") as client:
        assert client.get("/").status_code == 200 and client.get("/health").status_code == 200
        refused = client.get(reading(kind))
        assert refused.status_code == 401 and "--api-key" in refused.json()["error"]["message"]
        assert changing(client, kind).status_code == 401
        key = {"Authorization": "Bearer k3y"}
        assert client.get(reading(kind), headers=key).status_code == 200
        assert changing(client, kind, key).status_code == 200
        assert changing(client, kind, {**key, "Origin": "http://evil.example"}).status_code == 403  # key or not


def test_a_listener_on_every_address_answers_its_addresses_not_other_names(server, kind):
    with server(host="0.0.0.0", api_key="k3y") as client:
        key = {"Authorization": "Bearer k3y"}
        assert client.get(reading(kind), headers={**key, "Host": "192.168.1.20:8000"}).status_code == 200
        assert client.get(reading(kind), headers={**key, "Host": "evil.example:8000"}).status_code == 403


def test_the_page_token_is_exchanged_for_a_cookie(tmp_path):
    """qatune ui: the link it prints carries a token; the first visit keeps it in an HttpOnly, SameSite=Strict cookie
    and leaves the address bar without it; every request of the page then carries the cookie."""
    from qatune.ui.app import UiSettings, create_app
    from qatune.ui.workspace import Workspace

    app = create_app(Workspace(tmp_path / "ws"), UiSettings(port=8080, token="s3cret-token"))
    with TestClient(app, base_url="http://127.0.0.1:8080", follow_redirects=False) as client:
        assert client.get("/api/state").status_code == 401
        wrong = client.get("/?token=guess")
        assert wrong.status_code == 401 and "open the link it printed" in wrong.json()["error"]["message"]
        assert "set-cookie" not in wrong.headers
        visit = client.get("/?token=s3cret-token")
        assert visit.status_code == 303 and visit.headers["location"] == "/"
        cookie = visit.headers["set-cookie"]
        assert cookie.startswith("qatune-token-8080=s3cret-token;")
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert client.cookies.get("qatune-token-8080") == "s3cret-token"
        assert client.get("/api/state").status_code == 200
        own = {"Origin": "http://127.0.0.1:8080"}
        assert client.post("/api/sheets?name=faq.csv", content=FAQ, headers=own).status_code == 200
        # the same cookie from another site's page (a browser would not send it; a script holding it is refused)
        assert client.post("/api/sheets?name=faq.csv", content=FAQ,
                           headers={"Origin": "http://evil.example"}).status_code == 403
        client.cookies.clear()
        assert client.get("/api/state", headers={"Authorization": "Bearer s3cret-token"}).status_code == 200
        assert client.get("/api/state", headers={"Cookie": "qatune-token-8080=guess"}).status_code == 401
    assert (tmp_path / "ws" / "sheets").is_dir() and [p.name for p in (tmp_path / "ws" / "sheets").iterdir()] == [
        "faq.csv"]


def test_the_access_rules():
    from qatune.serve.guard import Access

    loopback = Access("qatune ui")
    assert all(loopback.host_allowed(h) for h in ("127.0.0.1:8080", "localhost", "[::1]:8080", "127.0.0.2"))
    assert not any(loopback.host_allowed(h) for h in (None, "", "evil.example", "10.0.0.1", "localhost.evil.example",
                                                       "127.0.0.1.nip.io"))
    assert Access("qatune ui", host="10.0.0.5").host_allowed("10.0.0.5:8080")
    assert not Access("qatune ui", host="10.0.0.5").host_allowed("10.0.0.6:8080")
    assert Access("qatune ui", allowed_hosts=("Proxy.Example",)).host_allowed("proxy.example:443")
    assert Access("qatune ui", api_key="k", token="t").secrets == (b"k", b"t")


def test_what_browsers_and_other_apps_send_is_read_as_they_mean_it(server, kind):
    """Another app's cookies on this host do not hide the page's; a read that another site's page makes (an <img>, a
    frame) is refused; every answer forbids framing; malformed headers are refused, never a 500."""
    with server(token="t0ken") as client:
        secret = {"Authorization": "Bearer t0ken"} if kind == "serve" else {}
        if kind == "ui":
            for cookie in ('a=b c; qatune-token-8000=t0ken', 'j={"a":1}; qatune-token-8000=t0ken',
                           'qatune-token-8000=wrong; qatune-token-8000=t0ken', 'path=/; qatune-token-8000=t0ken'):
                assert client.get(reading(kind), headers={"Cookie": cookie}).status_code == 200, cookie
            secret = {"Cookie": "qatune-token-8000=t0ken"}
        for site in ("cross-site", "same-site"):
            refused = client.get(reading(kind), headers={**secret, "Sec-Fetch-Site": site})
            assert refused.status_code == 403 and f"Sec-Fetch-Site: {site}" in refused.json()["error"]["message"]
        assert client.get(reading(kind), headers={**secret, "Sec-Fetch-Site": "same-origin"}).status_code == 200
        assert client.get("/", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 200  # a link to the page
        answer = client.get("/")
        assert answer.headers["x-frame-options"] == "SAMEORIGIN"
        assert answer.headers["content-security-policy"] == "frame-ancestors 'self'"
        for host in ("[::1", "127.0.0.1:abc", "evil@127.0.0.1", "127.0.0.1:8000.evil.example", "127.0.0.1:99999",
                     "127.0.0.1/x"):
            assert client.get(reading(kind), headers={**secret, "Host": host}).status_code == 403, host
        for origin in ("http://127.0.0.1:99999", "http://127.0.0.1:8000.evil.example", "file://127.0.0.1:8000",
                       "chrome-extension://127.0.0.1:8000", "http://127.0.0.1:abc"):
            assert changing(client, kind, {**secret, "Origin": origin}).status_code == 403, origin
        lying = client.get(reading(kind), headers={**secret, "Content-Length": "1e3"})
        assert lying.status_code == 400


def test_a_websocket_is_closed_and_names_are_checked(server, kind):
    from starlette.websockets import WebSocketDisconnect

    from qatune.errors import QatuneError
    from qatune.serve.guard import Access

    with server() as client, pytest.raises(WebSocketDisconnect) as closed:
        with client.websocket_connect("/"):
            pass
    assert closed.value.code == 1008
    with pytest.raises(QatuneError, match=r"--allowed-host 'https://proxy\.example'"):
        Access("qatune ui", allowed_hosts=("https://proxy.example",))
