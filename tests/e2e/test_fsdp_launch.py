"""Launching on several machines: ``qatune train --nodes 2 --node-rank R --master HOST:PORT`` as two "machines" on
one host over loopback trains the same steps as one machine; a machine that never joins and machines started with
different configs end in one line; `accelerate launch` with an FSDP config trains as qatune's own fsdp."""

import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.e2e.test_fsdp import assert_same_steps, config, data, qatune  # noqa: F401 (data: a fixture)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


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
            "['train.learning_rate']; start every machine with the same config file") in outputs[0], outputs
    assert "Traceback" not in outputs[0], outputs
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


ACCELERATE_FSDP = """
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config: {fsdp_version: 2, fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP}
machine_rank: 0
mixed_precision: 'no'
num_machines: 1
num_processes: 2
use_cpu: true
"""


def test_accelerate_launch_with_an_fsdp_config_is_sharded_by_qatune(tmp_path, data):  # noqa: F811
    path = config(tmp_path, data, "{scratch: {n_layer: 2, n_embd: 32, n_head: 2, vocab_size: 300}}")
    (tmp_path / "fsdp.yaml").write_text(ACCELERATE_FSDP)
    qatune("train", "--config", path, "--output-dir", tmp_path / "qatune", "--quiet", "--set",
           "train.distributed=fsdp", processes=2)

    def launch(out, *sets):
        return subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                               str(tmp_path / "fsdp.yaml"), "-m", "qatune", "train", "--config", str(path),
                               "--output-dir", str(out), "--quiet", *sets], capture_output=True, text=True, cwd=ROOT,
                              check=False, env={**os.environ, "TMPDIR": str(tmp_path)})  # torchrun's log folders

    done = launch(tmp_path / "accelerate", "--set", "train.distributed=fsdp")
    assert done.returncode == 0, done.stderr
    assert "accelerate's FSDP config: the model is sharded by qatune (train.distributed fsdp)" in done.stderr
    assert "fsdp: 2 FSDPGPT2Block units and the root, sharded on 2 processes" in done.stderr
    assert_same_steps(tmp_path / "qatune", tmp_path / "accelerate", rel=1e-6)
    refused = launch(tmp_path / "ddp")
    assert refused.returncode != 0
    assert ("error: the accelerate config shards the model (distributed_type FSDP) and this config does not: set "
            "train.distributed: fsdp") in refused.stderr
    assert not (tmp_path / "ddp").exists()
