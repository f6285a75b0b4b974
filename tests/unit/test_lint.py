"""The code base stays clean under the rules pyproject.toml selects for ruff."""

import subprocess
import sys

from tests.conftest import ROOT


def test_ruff_finds_nothing():
    # Not through .gitignore: its runs/ (for run directories) also matches the packages src/qatune/runs and
    # tests/unit/runs, which ruff would otherwise skip without a word.
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--no-respect-gitignore", "src",
                           "tests", "bench"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
