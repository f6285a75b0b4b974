"""The torchrun command of ``qatune train --num-processes/--nodes``, when it is started and what it returns, the
addresses it refuses, the cores each process computes with, and the one-machine rendezvous that keeps to
loopback."""

import os
import signal
import socket
import subprocess

import psutil
import pytest

from qatune.commands import launch as launching
from qatune.commands.launch import launch, launches, parse_master, process_args, torchrun_command
from qatune.commands.torchrun import _local_rendezvous, keep_to_loopback, loopback_interface, share_cores
from qatune.errors import ConfigError


def test_one_machine_meets_on_loopback_in_a_rendezvous_of_its_own():
    command = torchrun_command(2, ["train", "--config", "c.yaml"])
    run_id = command[6].removeprefix("--rdzv-id=")
    assert command[1:] == ["-m", "qatune.commands.torchrun", "--nproc-per-node=2", "--nnodes=1",
                           "--rdzv-backend=qatune-local", f"--rdzv-id={run_id}", "--local-addr=127.0.0.1", "-m",
                           "qatune", "train", "--config", "c.yaml"]
    assert len(run_id) == 36 and torchrun_command(2, ["train"])[6] != command[6]  # a new id for every run


def listening(process=None):
    """The (address, port) pairs ``process`` (this one) listens on."""
    return {(c.laddr.ip, c.laddr.port) for c in (process or psutil.Process()).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def test_the_one_machine_rendezvous_keeps_its_state_in_a_file_and_serves_the_processes_on_loopback(tmp_path):
    """torchrun's own (--standalone) serves both from TCP stores on every interface, the state pickled."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    before = listening()
    handler = _local_rendezvous(RendezvousParameters(
        backend="qatune-local", endpoint=str(tmp_path / "rendezvous"), run_id="run", min_nodes=1, max_nodes=1,
        local_addr="127.0.0.1"))
    try:
        info = handler.next_rendezvous()
        shared = info.bootstrap_store_info  # MASTER_ADDR:MASTER_PORT of the processes
        assert (handler.get_backend(), info.rank, info.world_size) == ("qatune-local", 0, 1)
        assert listening() - before == {("127.0.0.1", shared.master_port)} and shared.master_addr == "127.0.0.1"
        assert [p.name for p in tmp_path.iterdir()] == ["rendezvous"]
        assert "torch.rendezvous.run" in (tmp_path / "rendezvous").read_bytes().decode("latin-1")
    finally:
        handler.shutdown()


def test_the_processes_connect_over_loopback_unless_told_otherwise(monkeypatch):
    assert loopback_interface() in {name for _, name in socket.if_nameindex()}
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # so that the test's end takes it away again
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth1")  # the user's own choice
    monkeypatch.setenv("PET_STANDALONE", "1")  # torchrun's --standalone would override the rendezvous
    for _ in range(2):  # as often as a process asks
        keep_to_loopback()
    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == (loopback_interface(), "eth1")
    assert "PET_STANDALONE" not in os.environ


def test_several_machines_meet_at_the_master():
    command = torchrun_command(4, ["train"], nodes=2, node_rank=1, master="node0.cluster:29500", join_timeout=30)
    assert command[4:10] == ["--nnodes=2", "--node-rank=1", "--master-addr=node0.cluster", "--master-port=29500",
                            "--rdzv-conf=timeout=30", "-m"]
    assert parse_master("[::1]:29500", 2) == ("::1", 29500)


@pytest.mark.parametrize("master,message", [
    (None, "--nodes 2 needs --master HOST:PORT: the address of the machine with --node-rank 0"),
    ("node0", "--master 'node0' is not HOST:PORT (e.g. node0.cluster:29500)"),
    ("node0:99999", "--master 'node0:99999' is not HOST:PORT"),
])
def test_a_bad_master_is_one_message(master, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        torchrun_command(1, ["train"], nodes=2, master=master)


def test_a_train_command_launches_the_processes_only_where_several_are_asked_for_and_it_is_not_one(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert (launches(1, 1), launches(2, 1), launches(1, 2)) == (False, True, True)
    monkeypatch.setenv("RANK", "0")  # a process torchrun started
    assert not launches(2, 1)


def test_the_launch_runs_torchrun_passes_on_ctrl_c_and_sigterm_and_ends_with_its_exit_code(monkeypatch):
    """A signal sent to the command alone (kill, a container's stop) reaches torchrun's agent,
    which stops the processes with a checkpoint; the command waits for them, and gets its own handlers back."""
    ran, passed = [], []

    class Torchrun(subprocess.Popen):
        def __init__(self, command):
            ran.append(command)

        def send_signal(self, signum):
            passed.append(signum)

        def wait(self, timeout=None):
            signal.raise_signal(signal.SIGINT)  # no KeyboardInterrupt here: the processes save their checkpoint
            signal.raise_signal(signal.SIGTERM)
            return 130

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(launching.subprocess, "Popen", Torchrun)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert launch(["train", "--config", "c.yaml"], 2, 1, 0, None, 30) == 130
    assert passed == [signal.SIGINT, signal.SIGTERM]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    expected = torchrun_command(2, ["train", "--config", "c.yaml"])
    assert [[a for a in command if not a.startswith("--rdzv-id=")] for command in ran] == [
        [a for a in expected if not a.startswith("--rdzv-id=")]]


def test_the_agent_takes_a_repeated_signal_within_a_second_as_the_same_one_and_passes_a_second_ctrl_c_on(
        monkeypatch):
    """A terminal's Ctrl-C reaches torchrun's agent twice (from the terminal, and passed on by the command): once is
    a stop with a checkpoint, twice would end the agent before the processes have saved it. A second Ctrl-C goes on
    to the processes, which stop at once."""
    from torch.distributed.elastic.multiprocessing import SignalException, api

    from qatune.commands import torchrun

    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)  # restored after
    passed = []
    monkeypatch.setattr(torchrun, "pass_on", passed.append)
    torchrun.handle_signals_once()
    with pytest.raises(SignalException):
        api._terminate_process_handler(signal.SIGINT, None)
    api._terminate_process_handler(signal.SIGINT, None)  # the same Ctrl-C
    api._terminate_process_handler(signal.SIGTERM, None)
    assert passed == []
    monkeypatch.setattr(torchrun, "SAME_SIGNAL", 0.0)  # as if a second had passed: a second Ctrl-C
    api._terminate_process_handler(signal.SIGINT, None)
    assert passed == [signal.SIGINT]


def test_each_process_reruns_this_train_command_without_the_launch_options():
    assert process_args("c.yaml", ("train.epochs=2", "seed=1"), "runs/x", True, None, True, verbose=True) == [
        "-v", "train", "--config", "c.yaml", "--set", "train.epochs=2", "--set", "seed=1", "--output-dir", "runs/x",
        "--overwrite", "--quiet"]
    assert process_args(None, (), None, False, "runs/x", False, verbose=False) == ["train", "--resume", "runs/x"]
    assert process_args("c.yaml", (), "runs/x", False, "", False, verbose=False) == [
        "train", "--config", "c.yaml", "--output-dir", "runs/x", "--resume"]


def test_each_process_computes_with_its_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("torch.get_num_threads", lambda: 16)  # what one process would compute with
    share_cores(["--nproc-per-node=3", "--nnodes=1", "-m", "qatune", "train"])
    assert os.environ["OMP_NUM_THREADS"] == "5"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own setting stays
    share_cores(["--nproc-per-node=3"])
    assert os.environ["OMP_NUM_THREADS"] == "2"
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("torch.get_num_threads", lambda: 1)
    share_cores(["--nproc-per-node=4"])
    assert os.environ["OMP_NUM_THREADS"] == "1"
    monkeypatch.delenv("OMP_NUM_THREADS")
    share_cores(["--nproc-per-node=auto"])  # torchrun counts the processes itself: left to it
    assert "OMP_NUM_THREADS" not in os.environ
