"""metrics.jsonl mirrored to TensorBoard."""

import json

import pytest

from qatune.train import train
from tests.conftest import tiny_config


def test_tensorboard_logs(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [(f"what is item {i}?", f"thing {i}") for i in range(20)]
    config = tiny_config(tmp_path, rows, "train.epochs=3", "train.batch_size=4", "data.validation_fraction=0.5",
                         "train.report_to=tensorboard")
    run_dir = train(config, output_dir=tmp_path / "run", progress=False)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"train"' in x]
    assert steps == list(range(1, 10))  # 10 training rows in batches of 4: 3 steps an epoch, each logged
    assert [e.step for e in events.Scalars("train/loss")] == steps
    assert len(events.Scalars("eval/f1")) == 3


def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path):
    """Resumed from an earlier checkpoint than its last logged step (as after a crash), the run logs steps 4-9
    again: TensorBoard hides the first writer's events from step 4 on, as metrics.jsonl drops its lines."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [(f"what is item {i}?", f"thing {i}") for i in range(20)]
    config = tiny_config(tmp_path, rows, "train.epochs=3", "train.batch_size=4", "data.validation_fraction=0.5",
                         "train.report_to=tensorboard", "train.save_every=3", "train.keep_checkpoints=5")
    run_dir = train(config, output_dir=tmp_path / "run", progress=False)
    train(config, output_dir=run_dir, resume=run_dir / "checkpoints" / "step-0000003", progress=False)
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [(x["step"], x["loss"]) for x in lines if x["event"] == "train"]
    assert [x for x, _ in logged] == list(range(1, 10))
    scalars = events.Scalars("train/loss")
    assert [e.step for e in scalars] == list(range(1, 10))  # each step once, not steps 4-9 twice
    assert [e.value for e in scalars] == pytest.approx([loss for _, loss in logged], rel=1e-6)  # float32 in events
    assert [e.step for e in events.Scalars("eval/f1")] == [x["step"] for x in lines if x["event"] == "eval"]
