"""A failure on one process ends every process at once: three processes on two "machines", sharing a store as
torchrun's processes do, one failing while the others are busy outside any collective."""

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PROCESS = """
import sys, time
from qatune.train.process_failure import FailureWatch

with FailureWatch(lambda message: print("recorded:", message, flush=True)) as watch:
    if sys.argv[1] == "fail":
        failure = watch.failed(RuntimeError("disk on fire"))
        print(f"raises {type(failure).__name__} ({failure.exit_code}): {failure}", flush=True)
    elif sys.argv[1] == "busy":
        time.sleep(120)
"""


def start(actions, machines, port):
    """One process per action, of ranks 0..N-1 on the machines given (torchrun's GROUP_RANK)."""
    env = {**os.environ, "WORLD_SIZE": str(len(actions)), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    processes = []
    for rank, (action, machine) in enumerate(zip(actions, machines, strict=True)):
        local = machines[:rank].count(machine)
        processes.append(subprocess.Popen(
            [sys.executable, "-c", PROCESS, action], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={**env, "RANK": str(rank), "LOCAL_RANK": str(local), "GROUP_RANK": str(machine)}))
    return processes


def test_one_failure_ends_every_process_with_its_message():
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    processes = start(["busy", "fail", "busy"], machines=[0, 0, 1], port=store.port)
    started = time.monotonic()
    outputs = [p.communicate(timeout=60) for p in processes]
    seconds = time.monotonic() - started
    message = ("process 1 of 3 failed: internal error: RuntimeError: disk on fire (run with -v for the traceback; "
               "please report it with the output of 'qatune env')")
    # process 0 ends with 0 on the failing process's machine (the failing one's code is the machine's, and ends
    # after it), process 2 with the failure's code on its own machine
    assert [p.returncode for p in processes] == [0, 0, 2], outputs
    (out0, err0), (out1, _), (out2, err2) = outputs
    assert out0 == f"recorded: {message}\n"          # each process records it (run.json, on the main one)
    assert out2 == f"recorded: {message}\n"
    assert out1 == f"raises ProcessFailed (2): {message}\n"
    assert "error:" not in err0                        # the failing process speaks for its own machine
    assert err2.splitlines()[-1] == f"error: {message}"  # one process of the other machine says it
    assert seconds < 30  # the busy ones sleep 120 s
