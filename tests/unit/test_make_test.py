"""make test's two processes (pytest-xdist, tests/conftest.py's scheduler): an end-to-end file's tests all run in one
process, in the file's order, while the other tests go to whichever process is free."""

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

E2E_FILE = "tests/e2e/test_bad_input.py"
OTHERS = "tests/unit/data/test_chat.py"


def test_an_end_to_end_files_tests_run_in_one_process_in_order():
    pytest.importorskip("xdist")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                           "-v", E2E_FILE, OTHERS], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = re.findall(r"^\[(gw\d)\] \[\s*\d+%\] PASSED (.+?) *$", done.stdout, re.MULTILINE)
    e2e = [(worker, test) for worker, test in ran if test.startswith(E2E_FILE)]
    collected = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                                E2E_FILE], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    in_file_order = [line for line in collected.splitlines() if line.startswith(E2E_FILE)]
    assert len(in_file_order) > 10 and [test for _, test in e2e] == in_file_order, done.stdout[-3000:]
    assert len({worker for worker, _ in e2e}) == 1, e2e
    assert any(test.startswith(OTHERS) for _, test in ran)
