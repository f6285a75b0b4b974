"""`qatune ui` refuses, in one line, to listen beyond this machine without a key."""

import pytest
from click.testing import CliRunner

from qatune.cli import cli

pytest.importorskip("fastapi")


def test_beyond_loopback_needs_a_key(tmp_path, monkeypatch):
    monkeypatch.delenv("QATUNE_API_KEY", raising=False)
    result = CliRunner().invoke(cli, ["ui", "--host", "0.0.0.0", "--workspace", str(tmp_path / "ws")])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: --host 0.0.0.0: the page trains models and reads and writes the workspace, "
                                    "so beyond this machine it needs a key: pass --api-key KEY")
    assert not (tmp_path / "ws").exists()  # refused before anything was made
    empty = CliRunner().invoke(cli, ["ui", "--api-key", " ", "--workspace", str(tmp_path / "ws")])
    assert empty.exit_code == 1 and "--api-key is empty" in empty.stderr


@pytest.mark.slow
def test_no_token_says_what_it_opens_and_still_refuses_other_sites(tmp_path):
    import httpx

    from tests.serve_runs import QatuneProcess

    server = QatuneProcess("ui", "--workspace", str(tmp_path / "ws"), "--port", "0", "--no-token")
    try:
        assert server.link == server.url + "/"  # no token in the link
        assert httpx.get(server.url + "/api/state").status_code == 200
        upload = httpx.post(server.url + "/api/sheets?name=s.csv", content=b"question,answer\nq,a\n",
                            headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
        assert upload.status_code == 403 and not (tmp_path / "ws" / "sheets").exists()
    finally:
        assert server.stop() == 0
    assert any("warning: --no-token: the page answers every request from this machine without a secret" in line
               for line in server.log)
