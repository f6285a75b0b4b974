"""bench/ against the code it measures: every script imports (a renamed qatune function breaks it here, not on the
day someone measures), and the step-speed check runs end to end on a tiny model."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

BENCH = ROOT / "bench"


@pytest.mark.slow
def test_every_bench_script_imports():
    # bench/quality/ on sys.path as `python bench/quality/NAME.py` puts it there (its scripts import each other).
    scripts = [*sorted(p.stem for p in BENCH.glob("*.py")), *sorted(p.stem for p in BENCH.glob("quality/*.py")),
               *sorted(f"probes.{p.stem}" for p in BENCH.glob("probes/*.py"))]
    assert len(scripts) == len(set(scripts)), "a script of bench/quality/ has the name of one of bench/"
    code = ("import importlib, sys\nsys.path[:0] = sys.argv[1:4]\n"
            "for name in sys.argv[4:]:\n    importlib.import_module(name)\n")
    done = subprocess.run([sys.executable, "-c", code, str(BENCH), str(BENCH / "quality"), str(ROOT / "src"), *scripts],
                          capture_output=True, text=True, cwd=BENCH, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_step_speed_runs_on_synthetic_rows(tmp_path):
    out = tmp_path / "step.json"
    done = subprocess.run([sys.executable, str(BENCH / "step_speed.py"), "--layers", "1", "--width", "64",
                           "--burn-in", "1", "--steps", "2", "--json", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(out.read_text(encoding="utf-8"))
    assert found["steps_timed"] == 2 and found["ms_per_step"] > 0 and 0 < found["mfu"] < 1
    assert "ms a step" in done.stdout
