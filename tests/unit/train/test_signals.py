"""What a stopped run says: the command that resumes it."""

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
