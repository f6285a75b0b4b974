"""metrics.jsonl mirrored to TensorBoard."""

import json

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
