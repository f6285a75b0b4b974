"""torchrun (``python -m qatune.commands.torchrun ARGS``, as ``python -m torch.distributed.run ARGS``), ending in
one line when a training process fails: the process has said why itself, and torchrun's traceback of the failure
adds nothing for the person who started the run."""

from __future__ import annotations

import signal
import sys


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode >= 0:
            return failure.exitcode or 1
        how = signal.Signals(-failure.exitcode).name if -failure.exitcode in signal.valid_signals() else "a signal"
        print(f"error: training process {rank} was killed by {how}; the others were stopped (continue from the "
              "newest checkpoint with --resume)", file=sys.stderr)
        return 128 - failure.exitcode
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
