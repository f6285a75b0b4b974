"""The commands the page runs as processes: one training at a time, stopped as Ctrl-C stops it."""

import sys
import time

import pytest

from qatune.ui import PageError
from qatune.ui.jobs import Jobs
from qatune.ui.workspace import Workspace

WAITS = ("import signal, sys, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
         "print('started', flush=True)\ntime.sleep(60)")
"""A stand-in for a long qatune command (Ctrl-C ends it with KeyboardInterrupt, exit code 1). It takes SIGINT
itself, as qatune train does (train/signals.py): a process started in the background of a script inherits SIGINT
ignored."""


def fake_qatune(monkeypatch, code):
    """Jobs run ``python -m qatune ARGS``; here ``python -c CODE ARGS``."""
    import qatune.ui.jobs as jobs_module

    real = jobs_module.subprocess.Popen

    def popen(command, **kwargs):
        assert command[1:3] == ["-m", "qatune"]
        return real([sys.executable, "-c", code, *command[3:]], **kwargs)

    monkeypatch.setattr(jobs_module.subprocess, "Popen", popen)


def wait_for(condition, timeout=30):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_one_training_at_a_time_and_stop_asks_it_to_stop(tmp_path, monkeypatch):
    fake_qatune(monkeypatch, WAITS)
    jobs = Jobs(Workspace(tmp_path))
    job = jobs.start("train", ["train", "--config", "configs/a.yaml"], "runs/a")
    assert job.command == "qatune train --config configs/a.yaml" and job.state == "running"
    with pytest.raises(PageError, match="a training is running already \\(runs/a: qatune train") as refused:
        jobs.start("train", ["train", "--config", "configs/b.yaml"], "runs/b")
    assert refused.value.status == 409
    wait_for(lambda: "started" in job.output_text())
    jobs.stop(job)
    wait_for(lambda: job.state != "running")
    assert job.state == "stopped" and job.as_json()["stopping"]
    again = jobs.start("train", ["train", "--resume", "runs/a"], "runs/a")
    assert again.state == "running"  # the next may start
    wait_for(lambda: "started" in again.output_text())
    jobs.shutdown(wait_s=30)
    assert again.state == "stopped"
    assert not jobs.running()


def test_a_finished_command_its_output_and_its_error_line(tmp_path, monkeypatch):
    fake_qatune(monkeypatch, "import sys\nprint('{\"ok\": true}')\n"
                             "sys.stderr.write('loading\\rtrain:  50%|#  | 1/2\\rtrain: 100%|## | 2/2\\r"
                             "generate:  50%|#  | 1/2\\rgenerate: 100%|## | 2/2\\n"
                             "error: the sheet is gone\\n')\nsys.exit(len(sys.argv) - 1)")
    jobs = Jobs(Workspace(tmp_path))
    ok = jobs.start("check", [], "configs/a.yaml")
    failed = jobs.start("check", ["x"], "configs/b.yaml")
    wait_for(lambda: ok.state != "running" and failed.state != "running")
    assert (ok.state, ok.output_text().strip(), ok.error_line()) == ("done", '{"ok": true}', None)
    assert (failed.state, failed.error_line()) == ("failed", "error: the sheet is gone")
    # each bar's last drawing: validation's after training's steps keeps the steps' line
    assert failed.log_lines() == ["loading", "train: 100%|## | 2/2", "generate: 100%|## | 2/2",
                                  "error: the sheet is gone"]
    assert jobs.latest("check") is failed and jobs.latest("check", "configs/a.yaml") is ok
    with pytest.raises(PageError, match="no command 'check-9'"):
        jobs.get("check-9")


def test_a_commands_bar_of_rows_read_on_from_where_it_stopped(tmp_path, monkeypatch):
    fake_qatune(monkeypatch, "import sys, time\n"
                             "sys.stderr.write('loading\\n\\rgenerate:   0%|   | 0/4 [00:00<?, ?row/s]')\n"
                             "sys.stderr.flush()\ntime.sleep(1.5)\n"
                             "sys.stderr.write('\\rgenerate:  50%|#  | 2/4 [00:02<00:02,  1.00row/s]\\x1b[A')\n"
                             "sys.stderr.flush()\ntime.sleep(60)")
    jobs = Jobs(Workspace(tmp_path))
    job = jobs.start("compare", [], "runs/a")
    wait_for(lambda: job.row_bar() is not None)
    assert job.row_bar()["done"] == 0
    wait_for(lambda: job.row_bar()["done"] == 2)
    found = job.as_json()
    assert {k: found["bar"][k] for k in ("desc", "done", "total", "remaining_s", "bar", "active")} == {
        "desc": "generate", "done": 2, "total": 4, "remaining_s": 2, "bar": 1, "active": True}
    assert found["log"] == ["loading", "generate:  50%|#  | 2/4 [00:02<00:02,  1.00row/s]"]  # no cursor moves
    jobs.shutdown(wait_s=30)
