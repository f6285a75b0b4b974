import pytest
from tests.serve_runs import ServerProcess, train_run


@pytest.fixture(scope="session")
def serve_run(tmp_path_factory):
    """A tiny causal run that knows the first 40 FAQ answers (for the qatune serve tests)."""
    return train_run("causal", tmp_path_factory.mktemp("serve-e2e"))


@pytest.fixture(scope="session")
def server(serve_run):
    """A real `qatune serve` on a free loopback port."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    process = ServerProcess(serve_run)
    yield process
    assert process.stop() == 0, "".join(process.log)
