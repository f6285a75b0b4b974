"""The lock that keeps a second qatune process out of a run directory: a stale one taken over, a place it cannot
be written named."""

import json
import os

import pytest

from qatune.errors import RunDirError
from qatune.runs.lock import RunLock


def test_a_lock_of_a_reused_pid_is_stale(tmp_path):
    lock = RunLock(tmp_path / "run")
    lock.path.write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "start_ticks": 1,
                                     "started": "long ago", "command": "qatune train"}))
    with lock:                                                      # same pid, other start time: taken over
        assert json.loads(lock.path.read_text())["start_ticks"] != 1
    assert not lock.path.exists()


def test_a_lock_in_an_unwritable_place_is_one_line(tmp_path):
    target = tmp_path / "file-not-dir"
    target.write_text("x")
    with pytest.raises(RunDirError, match="cannot lock run directory"):
        RunLock(target / "run").acquire()
