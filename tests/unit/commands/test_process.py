"""How a command's process ends: atexit handlers run, output is flushed, the exit code kept; an error line that
several processes meet is claimed once."""

import subprocess
import sys

from qatune.commands.process import first_to_say

EXIT_SCRIPT = """
import atexit, sys, threading, time
from qatune.commands.process import exit_without_teardown
atexit.register(lambda: print("atexit handler ran", file=sys.stderr))
sys.stdout.write("buffered output")  # a pipe: block-buffered, written only by the flush
if sys.argv[1] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished"))).start()
exit_without_teardown(int(sys.argv[2]))
print(" (teardown exit)")
sys.exit(int(sys.argv[2]))
"""


def test_exit_without_teardown_runs_atexit_handlers_flushes_and_keeps_the_code():
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, "plain", "3"], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "buffered output", "atexit handler ran\n")


def test_exit_without_teardown_leaves_the_exit_to_python_while_a_thread_runs():
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, "thread", "0"], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, "buffered output (teardown exit)\nthread finished\n",
                                                           "atexit handler ran\n")


def test_an_error_line_is_claimed_once_per_machine_and_attempt(tmp_path, monkeypatch):
    attempt = tmp_path / "attempt_0"  # torchrun's folder for this machine's processes: RANK/error.json in it
    for rank in (0, 1):
        (attempt / str(rank)).mkdir(parents=True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / "0" / "error.json"))
    assert first_to_say("data file x.csv not found")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / "1" / "error.json"))
    assert not first_to_say("data file x.csv not found")       # the same line: said by process 0
    assert first_to_say("process 1 of 2 failed: its own error")  # a line of its own
    assert first_to_say("data file \udcff.csv not found")       # a file name that is not UTF-8
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "gone" / "0" / "error.json"))
    assert first_to_say("data file x.csv not found")             # no folder to claim it in: said
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / "1" / "error.json"))
    assert first_to_say("data file x.csv not found")             # one process says its errors
