"""Training: ``train(config)`` wires the pieces; ``fit`` is the loop.

    preparation.py load the rows, build the model, encode, validate the first batches (nothing written)
    run.py         train(): check the output folder, create the run directory, or --resume
    outcome.py     fit with run.json true at every outcome, and the report
    resume.py      --resume from the newest checkpoint
    loop.py        fit() and train_step(): the loop itself; Loop.setup() builds what it steps
    optim.py       AdamW, warmup + StepLR, gradient clipping
    sampler.py     length-grouped, resumable batch order
    nan_guard.py   the NaN guard
    validation.py  per-epoch validation and best/
    checkpoint.py  resumable checkpoints: write, find the newest intact one, restore
    report.py      report.md and loss.png
    logs.py        metrics.jsonl and TensorBoard
    signals.py     Ctrl-C / SIGTERM: checkpoint and stop
    device.py      the accelerator (device, processes, mixed precision) and the seed

The speed paths plug into the loop through one object, :class:`qatune.speedups.Speedups`.
"""

from qatune.train.loop import Loop, fit, train_step
from qatune.train.optim import build_optimizer, build_schedulers, gradient_clipper
from qatune.train.preparation import Prepared, prepare
from qatune.train.run import train
from qatune.train.sampler import LengthGroupedBatches
from qatune.train.signals import TrainingInterrupted

__all__ = ["LengthGroupedBatches", "Loop", "Prepared", "TrainingInterrupted", "build_optimizer", "build_schedulers",
           "fit", "gradient_clipper", "prepare", "train", "train_step"]
