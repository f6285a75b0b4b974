"""How a qatune command's process ends."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path


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


def first_to_say(message: str) -> bool:
    """Whether this process prints ``message``, the error it ends with. Under torchrun every process of a machine
    that meets an error alike (a data file missing, a config refused) would print it: the first to claim the line,
    as a file in the folder torchrun keeps for this machine's processes of this attempt, does. True for a single
    process, under a launcher without that folder, or where the claim cannot be made."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # ATTEMPT/RANK/error.json
    if os.environ.get("WORLD_SIZE", "1") == "1" or not error_file:
        return True
    digest = hashlib.sha256(message.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    claim = Path(error_file).parent.parent / f"qatune-said-{digest}"
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        pass  # no folder to claim it in: said
    return True
