"""How a qatune command's process ends."""

from __future__ import annotations

import os
import sys


def exit_without_teardown(code: int) -> None:
    """End the process as a normal exit would, less the freeing of every object: the atexit handlers
    run, the standard streams are flushed, and then ``os._exit``. Returns (for the normal exit) while
    a thread that a normal exit waits for is still running."""
    import atexit
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: a normal exit would not report it either
            pass
    os._exit(code)
