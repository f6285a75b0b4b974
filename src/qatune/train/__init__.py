"""Training: ``train(config)`` wires the pieces; ``fit`` is the loop.

    preparation.py load the rows, build the model, encode, validate the first batches (nothing written)
    run.py         train(): the run directory, run.json at every outcome, the report
    resume.py      --resume from the newest checkpoint
    loop.py        fit() and train_step(): the loop itself
    optim.py       AdamW, warmup + StepLR, gradient clipping
    sampler.py     length-grouped, resumable batch order
    guard.py       the NaN guard
    validation.py  per-epoch validation and best/
    logs.py        metrics.jsonl and TensorBoard
    signals.py     Ctrl-C / SIGTERM: checkpoint and stop
    device.py      accelerator, precision, seed
"""

from qatune.train.loop import fit, train_step
from qatune.train.optim import build_optimizer, build_schedulers, gradient_clipper
from qatune.train.preparation import Prepared, prepare
from qatune.train.run import train
from qatune.train.sampler import LengthGroupedBatches
from qatune.train.signals import TrainingInterrupted

__all__ = ["LengthGroupedBatches", "Prepared", "TrainingInterrupted", "build_optimizer", "build_schedulers", "fit",
           "gradient_clipper", "prepare", "train", "train_step"]
