"""CI runs every test its machine has the programs for: with QATUNE_NO_SKIPS=1 (.ci/run), a test marked distributed,
browser or external that skips fails (it did not run); other skips (no CUDA GPU) stay skips. Tests that drive
Chromium or node's and Go's renderers are marked by their fixtures."""

from tests.conftest import ROOT

pytest_plugins = ["pytester"]

INNER = '''
import pytest

@pytest.fixture
def browser():
    pytest.skip("no chromium here")

@pytest.mark.external
def test_node():
    pytest.skip("node is not installed")

def test_page(browser):
    pass

@pytest.mark.gpu
def test_cuda():
    pytest.skip("needs a CUDA GPU")
'''


def test_a_test_that_must_run_fails_when_it_skips_in_ci(pytester, monkeypatch):
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text(encoding="utf-8"))
    pytester.makepyfile(test_inner=INNER)
    pytester.makeini("[pytest]\nmarkers =\n    external: x\n    browser: x\n    distributed: x\n    gpu: x\n")
    monkeypatch.setenv("QATUNE_NO_SKIPS", "1")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, errors=1, skipped=1)  # the fixture's skip fails its set-up
    result.stdout.fnmatch_lines(["*a test marked browser skipped where it must run (QATUNE_NO_SKIPS=1)*no chromium*",
                                 "*a test marked external skipped where it must run*node is not installed*"])
    monkeypatch.delenv("QATUNE_NO_SKIPS")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=3)
