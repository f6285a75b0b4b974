"""torchrun (``python -m qatune.commands.torchrun ARGS``, as ``python -m torch.distributed.run ARGS``), ending in
one line when a training process fails: the process has said why itself (naming itself), and torchrun's log line and
traceback of the failure, which name the first process to exit (often one that was stopped because another failed),
add nothing for the person who started the run. torchrun's folder for the processes' error files is a temporary one
removed at the end (torchrun's own default stays in the temporary directory after every run). Each process computes
with its share of the machine's cores, where torchrun gives each one thread (and warns that it did).

On one machine (``--rdzv-backend=qatune-local``) the rendezvous's state is a file of that folder (the user's alone),
and every port the run opens listens on 127.0.0.1. torchrun's own one-machine rendezvous (``--standalone``) serves
its state from a TCP store on every network interface, with no password, and its agent unpickles what it finds
there every few seconds: anyone on the network who reached the port could run code as the user.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import tempfile
import time
from typing import Any

import psutil

LOCAL_RENDEZVOUS = "qatune-local"
"""torchrun's ``--rdzv-backend`` for a run on this machine alone: its state in a file, its store on 127.0.0.1."""
LOOPBACK = "127.0.0.1"


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_without_narration)
    handle_signals_once()
    share_cores(argv)
    with tempfile.TemporaryDirectory(prefix="qatune-torchrun-", ignore_cleanup_errors=True) as logs:
        if f"--rdzv-backend={LOCAL_RENDEZVOUS}" in argv:
            keep_to_loopback()
            argv = [f"--rdzv-endpoint={os.path.join(logs, 'rendezvous')}", *argv]  # the state's file
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
        except SignalException:  # Ctrl-C, SIGTERM: the processes, told too, have said how they stopped
            return INTERRUPTED
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


INTERRUPTED = 130
"""The exit code of a run stopped by Ctrl-C or SIGTERM, as one process's (qatune's TrainingInterrupted)."""
SAME_SIGNAL = 1.0
"""Seconds within which the agent takes a repeat of a signal as the same one (as the processes do: SAME_CTRL_C)."""


def handle_signals_once() -> None:
    """The agent's handler of SIGINT and SIGTERM: the first stops the processes (each finishes its step and saves a
    checkpoint), and a repeat within SAME_SIGNAL is that one (a terminal's Ctrl-C reaches the agent both from the
    terminal and from ``qatune train``, which passes on what it gets). A later one, a second Ctrl-C, is passed on to
    the processes, which stop at once; torchrun's own handling of it would send them SIGTERM and wait 30 s."""
    from torch.distributed.elastic.multiprocessing import api

    handler, first = api._terminate_process_handler, []

    def once(signum: int, frame: Any) -> None:
        if not first:
            first.append(time.monotonic())
            handler(signum, frame)  # raises torchrun's SignalException: it stops the processes with this signal
        elif time.monotonic() - first[0] >= SAME_SIGNAL:
            pass_on(signum)

    api._terminate_process_handler = once  # what torchrun installs as it starts the processes


def pass_on(signum: int) -> None:
    """Send ``signum`` to the training processes (torchrun starts each in a process group of its own)."""
    for process in psutil.Process().children():
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            pass


def keep_to_loopback() -> None:
    """Make the one-machine rendezvous known to torchrun, and have the processes' own connections (gloo's, NCCL's
    bootstrap) use the loopback interface, unless the user named one."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(LOCAL_RENDEZVOUS, _local_rendezvous)
    os.environ.pop("PET_STANDALONE", None)  # torchrun would take --standalone from it, over the backend asked for
    interface = loopback_interface()
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if interface and variable not in os.environ:
            os.environ[variable] = interface


def loopback_interface() -> str | None:
    """The loopback interface's name (Linux's ``lo``, macOS's ``lo0``), where the system lists it."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if name in ("lo", "lo0")), None)


def _local_rendezvous(params: Any) -> Any:
    """torchrun's c10d rendezvous handler, its state in the file ``--rdzv-endpoint`` names (in a folder of the
    user's alone), the store it shares with the processes (MASTER_ADDR:MASTER_PORT) on 127.0.0.1."""
    from torch.distributed import FileStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class LocalBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return LOCAL_RENDEZVOUS  # torchrun checks the handler's backend against the one it asked for

    store = FileStore(params.endpoint)
    handler = create_handler(store, LocalBackend(store, params.run_id), params)
    # torch's own store server listens on every interface: TCPStore takes no address to bind.
    handler._create_tcp_store_server = lambda addr, port: loopback_store()
    return handler


def loopback_store() -> Any:
    """A TCP store served from a socket bound to 127.0.0.1 (a free port)."""
    from torch.distributed import TCPStore

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((LOOPBACK, 0))
    listener.listen(socket.SOMAXCONN)
    port = listener.getsockname()[1]
    return TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, master_listen_fd=listener.detach())


NARRATION = ("failed (exitcode", "Received %s death signal", "Sending process %s closing signal")
"""torchrun's lines on a failure or a stop that qatune's one line says: "failed (exitcode: N) local_rank: R", and
Ctrl-C's "Received 2 death signal, shutting down workers" and "Sending process P closing signal SIGINT"."""


def _without_narration(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(NARRATION)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
