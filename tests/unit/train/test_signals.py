"""What a stopped run says: the command that resumes it; when a second Ctrl-C stops at once."""

import pytest

from qatune.train import TrainingInterrupted


def test_the_stop_message_names_the_command_that_resumes(tmp_path):
    from qatune.train.checkpoint import TrainState

    checkpoint = tmp_path / "my runs" / "faq" / "checkpoints" / "step-0000005"
    one = TrainingInterrupted("SIGTERM", TrainState(step=5, epoch=1), checkpoint)
    assert str(one) == (f"training stopped by SIGTERM at step 5 (after epoch 1); checkpoint saved in {checkpoint}; "
                        f"resume with: qatune train --resume '{tmp_path / 'my runs' / 'faq'}'")
    two = TrainingInterrupted("SIGINT", TrainState(step=5, epoch=1, consumed=2), checkpoint, processes=2)
    assert str(two).startswith("training stopped by SIGINT at step 5 (in epoch 2);")
    assert str(two).endswith("--num-processes 2")


def test_a_second_sigint_within_a_second_is_the_same_ctrl_c_and_a_later_one_stops_at_once(monkeypatch):
    """A signal sent to every process of a job (a scheduler's) reaches a training process of a multi-process run
    directly and again from torchrun's agent: one stop arrives twice, and must still finish the step and save a
    checkpoint."""
    import signal

    from qatune.train import signals

    with signals.StopSignals() as stop:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # the agent's, a moment later
        assert stop.requested == "SIGINT"
        monkeypatch.setattr(signals, "SAME_CTRL_C", 0.0)  # as if a second had passed
        signal.raise_signal(signal.SIGTERM)  # the agent's as it shuts down: the stop goes on
        assert stop.requested == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def _agree(rank, store, asked, answers):
    """One of two processes: its own stop (or none) in, the one they agreed on out, for each case in turn."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from qatune.train.signals import StopSignals

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    stop, agreed = StopSignals(), []
    for case in asked:
        stop.requested = case[rank]
        agreed.append(stop.agreed(SimpleNamespace(num_processes=2, device=torch.device("cpu"))))
    (answers / str(rank)).write_text(repr(agreed))
    dist.destroy_process_group()


def test_the_processes_of_a_run_agree_on_a_stop_any_one_of_them_was_asked_for(tmp_path, monkeypatch):
    """A signal that reached one process (a scheduler's SIGTERM, or the terminal's a moment late) stops every process
    after the same step; of two signals, SIGTERM names the stop."""
    import torch.multiprocessing

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    asked = [(None, None), (None, "SIGTERM"), ("SIGINT", None), ("SIGINT", "SIGTERM"), ("SIGINT", "SIGINT")]
    torch.multiprocessing.spawn(_agree, args=(tmp_path / "store", asked, tmp_path), nprocs=2)
    expected = [None, "SIGTERM", "SIGINT", "SIGTERM", "SIGINT"]
    assert [eval((tmp_path / rank).read_text()) for rank in "01"] == [expected, expected]


def test_the_processes_of_a_stopped_run_then_ignore_the_launchers_sigterm_and_one_process_restores_its_handler():
    """torchrun's agent sends SIGTERM to the processes still running once one has ended: a stopped run's main process
    must still say its line. A run of one process (a library's caller) gets its own handler back."""
    import signal

    from qatune.train.checkpoint import TrainState
    from qatune.train.signals import StopSignals

    before = signal.getsignal(signal.SIGTERM)
    try:
        for processes, after in [(1, before), (2, signal.SIG_IGN)]:
            with pytest.raises(TrainingInterrupted), StopSignals():
                raise TrainingInterrupted("SIGINT", TrainState(step=1), None, processes)
            assert signal.getsignal(signal.SIGTERM) == after
    finally:
        signal.signal(signal.SIGTERM, before)
