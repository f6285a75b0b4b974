"""Validation after each epoch: metrics, predictions-validation.csv, whether the chosen metric improved."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from qatune.evaluation.evaluate import evaluation_parts, metrics_from, write_predictions
from qatune.inference.lockstep import Lockstep
from qatune.inference.metric_records import said
from qatune.runs import layout
from qatune.train.checkpoint import TrainState
from qatune.train.device import peak_memory_mb
from qatune.train.logs import MetricsLog
from qatune.train.preparation import Prepared

log = logging.getLogger("qatune")


def evaluate_epoch(prepared: Prepared, model: torch.nn.Module, run_dir: Path | None, state: TrainState,
                   metrics_log: MetricsLog, accelerator: Any, sharded: bool = False, progress: bool = False) -> bool:
    """Evaluate on the validation rows; returns whether the chosen metric improved (the caller saves best/).
    ``progress``: a bar of the rows answered on stderr (the main process's, as training's own bar).

    With several processes each evaluates every n-th row; predictions and loss sums are gathered so that every
    process computes the same metrics (and takes the same early-stopping decision). A ``sharded`` model's
    forwards gather weights from every process, so the processes go in lockstep (:mod:`qatune.inference.lockstep`)
    through the model's own forward (the speed paths call its parts, which would not gather); with fewer rows than
    processes, every process evaluates every row.
    """
    config, records = prepared.config, prepared.eval_records
    rank, world = accelerator.process_index, accelerator.num_processes
    lockstep = None
    if sharded:
        if len(records) < world:
            rank, world = 0, 1
        else:
            lockstep = Lockstep(accelerator.device)
    mine = list(range(rank, len(records), world))
    predictions, loss_sum, count = evaluation_parts(model, prepared.tokenizer, prepared.info,
                                                    [records[i] for i in mine], config.generate,
                                                    config.train.eval_batch_size,
                                                    progress=progress and accelerator.is_main_process,
                                                    speedups="off" if sharded else config.train.speedups,
                                                    lockstep=lockstep)
    if world > 1:
        from accelerate.utils import gather_object

        pairs = dict(gather_object(list(zip(mine, predictions))))   # each row index exactly once
        predictions = [pairs[i] for i in range(len(records))]
        sums = gather_object([(loss_sum, count)])
        loss_sum, count = sum(s for s, _ in sums), sum(c for _, c in sums)
    metrics = metrics_from(prepared.info, records, predictions, loss_sum, count)
    model.train()
    metrics_log.write({"event": "eval", "epoch": state.epoch, "step": state.step, **metrics,
                       "peak_memory_mb": round(peak_memory_mb(accelerator.device), 1)})
    if run_dir is not None:
        write_predictions(run_dir / layout.VALIDATION_PREDICTIONS, records, predictions, prepared.info)
    log.info("epoch %d: eval %s (%d examples)", state.epoch, said(metrics), metrics["num_examples"])
    if not better(metrics, state.best, config.train.best_metric):
        state.stale_evals += 1
        return False
    state.best = {**metrics, "epoch": state.epoch, "step": state.step}
    state.stale_evals = 0
    return True


def better(metrics: dict[str, Any], best: dict[str, Any] | None, metric: str) -> bool:
    """Whether ``metrics`` beat ``best`` on ``metric`` (ties on F1/EM are broken by the lower loss)."""
    if best is None:
        return True
    if metric == "loss":
        return metrics["loss"] is not None and (best["loss"] is None or metrics["loss"] < best["loss"])
    loss, best_loss = metrics["loss"] or 0.0, best["loss"] or 0.0
    return (metrics[metric], -loss) > (best[metric], -best_loss)
