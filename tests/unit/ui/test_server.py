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
