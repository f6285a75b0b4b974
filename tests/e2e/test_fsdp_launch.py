"""Launching on several machines: ``qatune train --nodes 2 --node-rank R --master HOST:PORT`` as two "machines" on
one host over loopback trains the same steps as one machine; a machine that never joins, machines started with
different configs, and accelerate's own FSDP plugin end in one line."""

import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.e2e.test_fsdp import assert_same_steps, config, data, qatune  # noqa: F401 (data: a fixture)

pytestmark = pytest.mark.slow


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def machines(path, out, sets=((), ())):
    """Two one-process "machines" started by qatune's own launcher; their return codes and outputs."""
    port = free_port()
    started = [subprocess.Popen(
        [sys.executable, "-m", "qatune", "train", "--config", str(path), "--output-dir", str(out), "--quiet",
         "--set", "train.distributed=fsdp", *sets[rank], "--nodes", "2", "--node-rank", str(rank), "--master",
         f"127.0.0.1:{port}", "--join-timeout", "120"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for rank in (0, 1)]
    outputs = [machine.communicate(timeout=600)[0] for machine in started]
    return [machine.returncode for machine in started], outputs


def test_two_machines_train_as_one(tmp_path, data):  # noqa: F811
    path = config(tmp_path, data, "{scratch: {n_layer: 2, n_embd: 32, n_head: 2, vocab_size: 300}}")
    qatune("train", "--config", path, "--output-dir", tmp_path / "single", "--quiet", "--set",
           "train.distributed=fsdp", processes=2)
    codes, outputs = machines(path, tmp_path / "nodes")
    assert codes == [0, 0], "\n".join(outputs)
    assert_same_steps(tmp_path / "single", tmp_path / "nodes", rel=1e-6)


def test_machines_with_different_configs_are_refused(tmp_path, data):  # noqa: F811
    path = config(tmp_path, data, "{scratch: {n_layer: 2, n_embd: 32, n_head: 2, vocab_size: 300}}")
    codes, outputs = machines(path, tmp_path / "run", sets=((), ("--set", "train.learning_rate=0.01")))
    assert codes[0] != 0 and codes[1] != 0, outputs
    assert ("error: the processes were started with different set-ups: process 1 differs from process 0 in "
            "['train.learning_rate']; start every machine with the same config file") in outputs[0]
    assert "Traceback" not in outputs[0]
    assert not (tmp_path / "run" / "final").exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_machine_that_never_joins_is_a_rendezvous_timeout(rank, tmp_path, data):  # noqa: F811
    path = config(tmp_path, data, "{scratch: {n_layer: 2, n_embd: 32, n_head: 2, vocab_size: 300}}")
    done = subprocess.run([sys.executable, "-m", "qatune", "train", "--config", str(path), "--output-dir",
                           str(tmp_path / "run"), "--set", "train.distributed=fsdp", "--nodes", "2", "--node-rank",
                           str(rank), "--master", f"127.0.0.1:{free_port()}", "--join-timeout", "2"],
                          capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 1
    who = "the other machines did not all join" if rank == 0 else "the first machine (--node-rank 0) did not answer"
    assert done.stderr.startswith(f"error: rendezvous timeout: {who}"), done.stderr
    assert done.stderr.count("\n") == 1 and not (tmp_path / "run").exists()


def test_accelerates_fsdp_plugin_is_refused(tmp_path, data):  # noqa: F811
    path = config(tmp_path, data, "{scratch: {n_layer: 2, n_embd: 32, n_head: 2, vocab_size: 300}}")
    done = subprocess.run([sys.executable, "-m", "qatune", "train", "--config", str(path), "--output-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT, check=False,
                          env={**os.environ, "ACCELERATE_USE_FSDP": "true"})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "error: accelerate's FSDP plugin is on (ACCELERATE_USE_FSDP" in done.stderr
    assert not (tmp_path / "run").exists()
