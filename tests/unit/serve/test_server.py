"""The uvicorn process: which hosts count as this machine alone."""

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")


def test_which_hosts_count_as_loopback():
    from qatune.serve.server import is_loopback

    assert all(map(is_loopback, ["127.0.0.1", "127.5.0.1", "localhost", "::1", "[::1]"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.4", "example.org"]))
