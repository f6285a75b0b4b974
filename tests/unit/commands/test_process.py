"""How a command's process ends: atexit handlers run, output is flushed, the exit code kept."""

import subprocess
import sys

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
