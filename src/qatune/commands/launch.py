"""``qatune train --num-processes N [--nodes M --node-rank R --master HOST:PORT]``: the torchrun command that
starts the training processes of this machine, after every machine has joined.

torchrun waits for the other machines itself, and one that never comes ends in its own traceback. qatune first
meets the other machines at the master address (a TCP store, as torchrun's own rendezvous), so a machine that never
joins ends in one line naming the wait, and only then starts torchrun on the same address.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from qatune.commands.torchrun import LOCAL_RENDEZVOUS, LOOPBACK
from qatune.errors import ConfigError

log = logging.getLogger("qatune")

DEFAULT_JOIN_TIMEOUT = 600
"""Seconds each machine waits for the others (torchrun's own default)."""


def launches(processes: int, nodes: int) -> bool:
    """Whether this ``qatune train`` starts the training processes: several are asked for, and it is not one of
    them already (torchrun gives each the RANK it runs as)."""
    return (processes > 1 or nodes > 1) and "RANK" not in os.environ


def launch(qatune_args: list[str], processes: int, nodes: int, node_rank: int, master: str | None,
           join_timeout: int) -> int:
    """Start this machine's ``processes`` running ``qatune qatune_args`` under torchrun, once all ``nodes``
    machines have joined; their exit code."""
    command = torchrun_command(processes, qatune_args, nodes, node_rank, master, join_timeout)
    wait_for_machines(nodes, node_rank, master, join_timeout)
    log.info("launching %d processes on this machine: %s", processes, " ".join(command))
    with subprocess.Popen(command) as torchrun, passed_on(torchrun):
        return torchrun.wait()


@contextmanager
def passed_on(torchrun: subprocess.Popen) -> Iterator[None]:
    """While entered, Ctrl-C and SIGTERM sent to this command are passed on to torchrun's agent, which passes them on
    to the processes: they finish their step, save a checkpoint and stop, and this command waits for them. A
    terminal's Ctrl-C reaches the agent itself as well (not the processes: torchrun starts each in a process group of
    its own); the agent takes a repeat within a second as the same signal."""
    handled = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    previous = {sig: signal.signal(sig, lambda signum, _frame: torchrun.send_signal(signum)) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def parse_master(master: str | None, nodes: int) -> tuple[str, int]:
    """HOST:PORT of the first machine (node rank 0); with one machine, this one."""
    if master is None:
        if nodes > 1:
            raise ConfigError(f"--nodes {nodes} needs --master HOST:PORT: the address of the machine with "
                              "--node-rank 0, which every machine can reach (a free port, e.g. 29500)")
        return "127.0.0.1", 0
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--master {master!r} is not HOST:PORT (e.g. node0.cluster:29500)")
    return host.strip("[]"), int(port)


def process_args(config_path: str | None, overrides: tuple[str, ...], output_dir: str | None, overwrite: bool,
                 resume: str | None, quiet: bool, verbose: bool) -> list[str]:
    """The qatune arguments each launched process runs: this ``qatune train``'s own, without the launch options."""
    args = ["-v"] if verbose else []
    args += ["train", *(["--config", config_path] if config_path else []),
             *[x for o in overrides for x in ("--set", o)]]
    args += ["--output-dir", output_dir] if output_dir else []
    args += ["--overwrite"] if overwrite else []
    args += ["--resume", resume] if resume else (["--resume"] if resume == "" else [])
    return args + (["--quiet"] if quiet else [])


def torchrun_command(processes: int, qatune_args: list[str], nodes: int = 1, node_rank: int = 0,
                     master: str | None = None, join_timeout: int = DEFAULT_JOIN_TIMEOUT) -> list[str]:
    """The torchrun command that starts this machine's ``processes`` running ``qatune qatune_args``."""
    return [*torchrun_launcher(processes, nodes, node_rank, master, join_timeout), "-m", "qatune", *qatune_args]


def torchrun_launcher(processes: int, nodes: int = 1, node_rank: int = 0, master: str | None = None,
                      join_timeout: int = DEFAULT_JOIN_TIMEOUT) -> list[str]:
    """The torchrun command that starts this machine's ``processes``, up to what they run (a script, ``-m``)."""
    launch = [sys.executable, "-m", "qatune.commands.torchrun", f"--nproc-per-node={processes}"]
    if nodes == 1:  # torchrun's --standalone, its ports on loopback only
        launch += ["--nnodes=1", f"--rdzv-backend={LOCAL_RENDEZVOUS}", f"--rdzv-id={uuid.uuid4()}",
                   f"--local-addr={LOOPBACK}"]
    else:
        host, port = parse_master(master, nodes)
        launch += [f"--nnodes={nodes}", f"--node-rank={node_rank}", f"--master-addr={host}",
                   f"--master-port={port}", f"--rdzv-conf=timeout={join_timeout}"]
    return launch


def wait_for_machines(nodes: int, node_rank: int, master: str | None, timeout: int) -> None:
    """Return once all ``nodes`` machines have reached the master address; a machine that does not join within
    ``timeout`` seconds ends it with a :class:`ConfigError` on every machine that waited."""
    if nodes == 1:
        return
    if not 0 <= node_rank < nodes:
        raise ConfigError(f"--node-rank {node_rank} is not one of 0..{nodes - 1} (--nodes {nodes})")
    from torch.distributed import TCPStore

    host, port = parse_master(master, nodes)
    first = node_rank == 0
    try:
        # The first machine's store waits until the others have connected; they wait for its word to go on.
        with _native_logs_silenced():  # c10d logs each failed connection, with a C++ stack, on stderr
            # Every machine counts itself in (wait_for_workers); only the first one's store waits for the count.
            store = TCPStore(host, port, world_size=nodes, is_master=first, timeout=timedelta(seconds=timeout),
                             wait_for_workers=True)
        if first:
            store.set(_READY, "1")
            store.wait([f"{_LEFT}{rank}" for rank in range(1, nodes)])  # every other machine has read the word
        else:
            store.wait([_READY])
            store.set(f"{_LEFT}{node_rank}", "1")
    except RuntimeError as exc:  # DistStoreError, DistNetworkError: a timeout or a refused connection
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        who = ("the other machines did not all join" if first
               else f"the first machine (--node-rank 0) did not answer at {host}:{port}")
        raise ConfigError(f"rendezvous timeout: {who} within {timeout} s ({detail}); start the same command on "
                          f"every machine with --nodes {nodes} and its own --node-rank (0..{nodes - 1}), check "
                          f"that {host}:{port} is reachable, or give them longer with --join-timeout") from None
    if not first:
        _wait_until_closed(store)  # torchrun's store will take the port: never meet this one there
    del store


_READY = "qatune-all-joined"
_LEFT = "qatune-going-on-"


def _wait_until_closed(store: Any, limit: float = 30.0) -> None:
    """Return once the first machine has closed ``store`` (a request to it fails), or after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            with _native_logs_silenced():
                store.check([_READY])
        except RuntimeError:
            return
        time.sleep(0.1)


@contextmanager
def _native_logs_silenced() -> Iterator[None]:
    """Native code's writes to stderr (file descriptor 2) dropped while this is entered."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
