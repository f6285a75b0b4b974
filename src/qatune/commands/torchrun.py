"""torchrun (``python -m qatune.commands.torchrun ARGS``, as ``python -m torch.distributed.run ARGS``), ending in
one line when a training process fails: the process has said why itself (naming itself), and torchrun's log line and
traceback of the failure, which name the first process to exit (often one that was stopped because another failed),
add nothing for the person who started the run. torchrun's folder for the processes' error files is a temporary one
removed at the end (torchrun's own default stays in the temporary directory after every run). Each process computes
with its share of the machine's cores, where torchrun gives each one thread (and warns that it did)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_without_failure_line)
    share_cores(argv)
    with tempfile.TemporaryDirectory(prefix="qatune-torchrun-", ignore_cleanup_errors=True) as logs:
        try:
            # A log folder the user named (PET_LOG_DIR, with PET_REDIRECTS or PET_TEE) is theirs to keep.
            torchrun([*([] if os.environ.get("PET_LOG_DIR") else [f"--log-dir={logs}"]), *argv])
        except ChildFailedError as exc:
            rank, failure = exc.get_first_failure()
            if failure.exitcode >= 0:
                return failure.exitcode or 1
            how = (signal.Signals(-failure.exitcode).name if -failure.exitcode in signal.valid_signals()
                   else "a signal")
            print(f"error: training process {rank} was killed by {how}; the others were stopped (continue from the "
                  "newest checkpoint with --resume)", file=sys.stderr)
            return 128 - failure.exitcode
    return 0


def share_cores(argv: list[str]) -> None:
    """OMP_NUM_THREADS for the processes, when it is not set: the threads torch would compute with in one process
    (its default: the machine's cores) divided among the ``--nproc-per-node`` processes. torchrun would set 1, which
    leaves all but one core per process idle on a CPU."""
    import torch

    given = next((a.split("=", 1)[1] for a in argv if a.startswith("--nproc-per-node=")), "")
    if "OMP_NUM_THREADS" in os.environ or not given.isdigit() or int(given) < 1:
        return  # the user's setting, or a count torchrun works out itself (auto, gpu)
    os.environ["OMP_NUM_THREADS"] = str(max(1, torch.get_num_threads() // int(given)))


def _without_failure_line(record: logging.LogRecord) -> bool:
    """torchrun's "failed (exitcode: N) local_rank: R" line: left out."""
    return not str(record.msg).startswith("failed (exitcode")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
