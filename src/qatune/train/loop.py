"""The training loop: ``fit`` over epochs and accumulation windows, ``train_step`` for one update.

One step: forward and backward over the window's micro-batches (the loss summed, divided by the
supervised items of the whole window), clip (the norm is logged before clipping), check that loss
and norm are finite, optimizer step, scheduler step. The speed paths (:mod:`qatune.speedups`, behind
``train.speedups``) plug in through the ``speedups`` object at named points: before each forward, after each
backward, after each update. Checkpoints, logging and validation are calls out of the loop.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from qatune.errors import TrainingError, row_list
from qatune.kinds import Kind, kind_of
from qatune.model.folder import save_model
from qatune.model.objectives import count_tokens, model_inputs
from qatune.runs import layout
from qatune.speedups import Speedups
from qatune.train import sharding
from qatune.train.averaging import WeightAverage
from qatune.train.checkpoint import TrainState, model_folder_from, restore, save_checkpoint
from qatune.train.device import check_same_setup, make_accelerator, peak_memory_mb
from qatune.train.heap import Heap, few_shapes
from qatune.train.logs import LogWindow, MetricsLog
from qatune.train.memory_estimate import checkpoint_activations
from qatune.train.nan_guard import NonFiniteGuard
from qatune.train.optim import build_optimizer, build_schedulers, gradient_clipper
from qatune.train.preparation import Prepared, fingerprint
from qatune.train.process_failure import on_every_process
from qatune.train.sampler import LengthGroupedBatches, training_batches, windows
from qatune.train.signals import StopSignals, TrainingInterrupted
from qatune.train.validation import evaluate_epoch

log = logging.getLogger("qatune")


def fit(prepared: Prepared, run_dir: Path | None, progress: bool = True, resume_from: Path | None = None,
        when_trained: Callable[[], Any] | None = None) -> dict[str, Any]:
    """The training loop. Returns the first/final training loss and the best evaluation metrics.

    With ``run_dir``, a resumable checkpoint is written every ``train.save_every`` steps, at each
    epoch end, and when SIGINT/SIGTERM asks to stop. ``resume_from`` continues from a checkpoint.
    ``when_trained`` is called once the last epoch's updates and validation are done, before its
    checkpoint is written (nothing is logged after it).
    """
    train_cfg = prepared.config.train
    loop = Loop.setup(prepared, run_dir, resume_from)
    loop.progress = progress
    state = loop.state
    bar = tqdm(total=loop.total_steps(), initial=state.step, desc="train", unit="step", file=sys.stderr,
               disable=not (progress and loop.main), dynamic_ncols=True)
    with StopSignals() as stop, loop.metrics_log.closed_on_error():
        for epoch in range(state.epoch, train_cfg.epochs):
            loop.start_epoch(epoch)
            for window, last in windows(loop.loader, train_cfg.gradient_accumulation_steps):
                loop.heap.before_step(sum(batch["input_ids"].numel() for batch in window), heaviest=last)
                state.consumed += len(window)
                done = train_step(loop, window)
                if done is not None:
                    loop.after_update(done, bar)
                if stopping := stop.agreed(loop.accelerator):
                    bar.close()
                    raise loop.interrupted(stopping, loop.checkpoint())
            loop.end_epoch(when_trained if epoch == train_cfg.epochs - 1 else None)
            # a stop that came during validation: the checkpoint is written
            if state.epoch < train_cfg.epochs and (stopping := stop.agreed(loop.accelerator)):
                bar.close()
                raise loop.interrupted(stopping, loop.last_checkpoint)
            if loop.patience_ran_out():
                break
        bar.close()
        return loop.finish()


def train_step(loop: Loop, window: list[dict[str, torch.Tensor]]) -> dict[str, Any] | None:
    """Forward/backward over one accumulation window, clip, check, step. None when no update was applied."""
    accelerator, objective, optimizer, speedups = loop.accelerator, loop.objective, loop.optimizer, loop.speedups
    state, guard = loop.state, loop.guard
    items = _global_count(accelerator, sum(loop.kind.count_items(b) for b in window))
    if items == 0:
        log.warning("step %d: a batch with no supervised tokens (rows %s); skipped", state.step + 1,
                    row_list(_batch_rows(window)))
        return None
    loss_sum = torch.zeros((), device=accelerator.device)
    logit_absmax = torch.zeros((), device=accelerator.device)
    for i, batch in enumerate(window):
        speedups.before_forward(batch)
        # Gradients are synchronised across processes only on the window's last micro-batch.
        with loop.no_sync() if i < len(window) - 1 else nullcontext():
            out = objective(**model_inputs(batch))
            accelerator.backward(out["loss_sum"] * accelerator.num_processes / items)
        speedups.after_backward()
        loss_sum += out["loss_sum"].detach()
        logit_absmax = torch.maximum(logit_absmax, out["logit_absmax"].float())
    grad_norm = loop.clip()
    # Loss and non-padding tokens summed over processes, in one collective.
    local_tokens = float(sum(count_tokens(b) for b in window))
    summed = accelerator.reduce(torch.stack([loss_sum.float(), loss_sum.new_tensor(local_tokens).float()]), "sum")
    # The one host-device sync of a step: the NaN guard must see loss and norm before the update.
    total, tokens, grad_norm, absmax = torch.cat([
        summed, torch.stack([torch.as_tensor(grad_norm, device=loss_sum.device).float(), logit_absmax])]).tolist()
    loss = total / items
    lr = optimizer.param_groups[0]["lr"]
    if math.isfinite(loss) and not math.isfinite(grad_norm) and accelerator.scaler is not None:
        # fp16 (GPU only) loss scale too high: the scaler skips this update and lowers the scale.
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if guard.scale_skip():
            return None
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        # The diagnosis reads the gradients (per-layer norms) before they are dropped.
        guard.record(state.step + 1, state.epoch + 1, loss, grad_norm, _batch_rows(window), lr, loop.named_grads(),
                     absmax)
        optimizer.zero_grad(set_to_none=True)
        if guard.should_stop():
            raise on_every_process(TrainingError(guard.stop_message()))  # loss and norm are every process's
        return None
    guard.ok()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    speedups.after_step()
    state.step += 1
    if loop.average is not None:
        loop.average.update(state.step)
    state.last_loss = loss
    if state.step == 1:
        state.first_loss = loss
    return {"loss": loss, "items": items, "tokens": int(tokens), "lr": lr, "grad_norm": grad_norm}


@dataclass
class Loop:
    """What ``fit`` sets up once, and the bookkeeping around each update and each epoch."""

    prepared: Prepared
    run_dir: Path | None
    accelerator: Any
    speedups: Speedups
    objective: torch.nn.Module
    optimizer: Any
    loader: Any
    sampler: LengthGroupedBatches
    clip: Callable[[], Any]
    schedulers: dict[str, Any]
    state: TrainState
    guard: NonFiniteGuard
    metrics_log: MetricsLog
    average: WeightAverage | None = None
    """train.ema_decay: the moving average of the weights that validation, best/ and final/ see."""
    logged: LogWindow = field(default_factory=LogWindow)
    heap: Heap = field(default_factory=Heap)
    progress: bool = False
    """Bars on stderr: training's steps, validation's rows."""
    last_checkpoint: Path | None = None
    checkpointed: int | None = None
    """The step of the last checkpoint written (known to every process; its path only to the main one)."""

    @classmethod
    def setup(cls, prepared: Prepared, run_dir: Path | None, resume_from: Path | None) -> Loop:
        config, train_cfg = prepared.config, prepared.config.train
        accelerator = make_accelerator(config, prepared.precision)
        check_same_setup(accelerator, config, fingerprint(prepared))
        sharded = train_cfg.distributed == "fsdp"
        speedups = Speedups(train_cfg.speedups, prepared.precision, accelerator.device, accelerator.num_processes,
                            sharded=sharded)
        if train_cfg.activation_checkpointing:
            log.info("%s", checkpoint_activations(prepared.model))
        objective = speedups.attach(prepared.model, kind_of(config.task).objective(prepared.model),
                                    max(prepared.dataset.lengths, default=0))
        if sharded:
            log.info("%s", sharding.shard(prepared.model, prepared.precision, accelerator.device,
                                          offload=train_cfg.cpu_offload))
        few_shapes(prepared.collator, prepared.precision, accelerator.device.type)
        collator = speedups.collator(prepared.collator)
        optimizer = build_optimizer(speedups.parameters(objective), train_cfg.learning_rate, train_cfg.weight_decay)
        sampler = training_batches(prepared.dataset, config)
        if (batches := sampler.prefix_batches(train_cfg, speedups.on("prefix_groups"))) is not None:
            log.info("batches: %s", batches)
        # Its own generator: starting an epoch must not draw from the global RNG that dropout uses, so a
        # resumed run sees the same dropout masks as an uninterrupted one.
        loader = torch.utils.data.DataLoader(prepared.dataset, batch_sampler=sampler, collate_fn=collator,
                                             generator=torch.Generator().manual_seed(config.seed))
        if sharded:  # accelerate would wrap the sharded model in DDP: it prepares the optimizer and data only
            optimizer, loader = accelerator.prepare(optimizer, loader)
        else:
            objective, optimizer, loader = accelerator.prepare(objective, optimizer, loader)
        warmup, decay = build_schedulers(optimizer, config)
        # After prepare, which puts the weights on the device: the average is kept beside them.
        average = (WeightAverage([p for group in _torch_optimizer(optimizer).param_groups for p in group["params"]],
                                 train_cfg.ema_decay, prepared.model if sharded else None)
                   if train_cfg.ema_decay is not None else None)
        schedulers = {"warmup": warmup, "decay": decay}
        main = accelerator.is_main_process
        metrics_log = MetricsLog(run_dir / layout.METRICS if run_dir and main else None, train_cfg.report_to, config,
                                 resumed_from=resume_from)
        with metrics_log.closed_on_error():  # a failure from here on ends the trackers' runs as failed
            state = TrainState()
            if resume_from is not None:
                by_name = average.by_name if average else None
                shards = (lambda folder: sharding.load_shards(prepared.model, _torch_optimizer(optimizer), folder,
                                                              by_name)) if sharded else None
                state = restore(resume_from, optimizer, schedulers, load_shards=shards)
                if average is not None and not sharded:
                    average.load(resume_from)
                metrics_log.truncate_after(state.step)
                at = (f"epoch {state.epoch + 1} of {train_cfg.epochs}" if state.epoch < train_cfg.epochs
                      else f"after epoch {state.epoch} of {train_cfg.epochs}")
                log.info("resuming from %s (step %d, %s)", resume_from, state.step, at)
            guard = NonFiniteGuard(run_dir if main else None, train_cfg.on_nonfinite, train_cfg.max_nonfinite_steps,
                                   prepared.precision, state.bad_steps)
            clip = (speedups.clipper(accelerator, optimizer, train_cfg.max_grad_norm)
                    or gradient_clipper(accelerator, speedups.parameters(objective), train_cfg.max_grad_norm))
            if sharded:
                clip = _whole(clip)
            log.info("%s", speedups.describe())
            if average is not None:
                log.info("validation, best/ and final/ use a moving average of the weights (train.ema_decay %g)",
                         train_cfg.ema_decay)
            return cls(prepared, run_dir, accelerator, speedups, objective, optimizer, loader, sampler, clip,
                       schedulers, state, guard, metrics_log, average,
                       LogWindow.restored(state.log_window))

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def kind(self) -> Kind:
        return kind_of(self.prepared.config.task)

    @property
    def sharded(self) -> bool:
        return self.prepared.config.train.distributed == "fsdp"

    def no_sync(self) -> Any:
        """A context in which backward accumulates gradients without synchronising them across processes."""
        if self.sharded:
            return sharding.without_gradient_sync(self.model())
        return self.accelerator.no_sync(self.objective)

    def gathered(self) -> dict[str, Any] | None:
        """A sharded model's weights gathered whole on the main process, every process taking part; None for a
        model that is not sharded (they are read from the model itself)."""
        return sharding.gathered_weights(self.model()) if self.sharded else None

    def model(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.objective).model

    def full_precision(self) -> Any:
        """The model with its fp32 weights while this is entered (``bf16_master_weights`` trains bf16 ones)."""
        return self.speedups.full_precision()

    def averaged(self) -> Any:
        """The model with train.ema_decay's average of its weights while this is entered (as trained without it)."""
        return self.average.swapped_in() if self.average is not None else nullcontext()

    @contextmanager
    def delivered(self) -> Iterator[None]:
        """The model as validation and best/ see it while this is entered: its fp32 weights, averaged."""
        with self.full_precision(), self.averaged():
            try:
                yield
            finally:
                if self.sharded:  # before the trained weights are back: no unit keeps what validation gathered
                    sharding.reshard(self.model())

    def named_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.sharded:
            return sharding.named_full_grads(self.model())
        return self.speedups.named_grads(self.model())

    def total_steps(self) -> int:
        """The run's optimizer steps: windows of train.gradient_accumulation_steps batches of each process's share
        of an epoch's batches (the loader's length; the sampler's counts every process's batches)."""
        train_cfg = self.prepared.config.train
        return math.ceil(len(self.loader) / train_cfg.gradient_accumulation_steps) * train_cfg.epochs

    def start_epoch(self, epoch: int) -> None:
        self.state.epoch = epoch
        self.sampler.set_epoch(epoch)
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(epoch)  # accelerate's loader re-sets the sampler's epoch from its own count
        self.sampler.skip(self.state.consumed * self.accelerator.num_processes)
        self.objective.train()

    def after_update(self, done: dict[str, Any], bar: Any) -> None:
        """Schedules, the log line and the periodic checkpoint, after an applied update."""
        train_cfg, state = self.prepared.config.train, self.state
        if self.schedulers["warmup"] is not None:
            self.schedulers["warmup"].step()
        if train_cfg.scheduler.interval == "step":
            self.schedulers["decay"].step()
        self.logged.add(done["loss"], done["items"], done["tokens"])
        bar.update(1)
        rss_mb = self.heap.after_update()
        if state.step == 1 or state.step % train_cfg.logging_steps == 0:
            record = self.logged.flush(step=state.step, epoch=state.epoch + 1, lr=done["lr"],
                                       grad_norm=done["grad_norm"], supervised=done["items"])
            record["peak_memory_mb"] = round(peak_memory_mb(self.accelerator.device), 1)
            record["rss_mb"] = rss_mb
            self.metrics_log.write({"event": "train", **record})
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{done['lr']:.2e}",
                            tok_s=f"{record['tokens_per_s']:.0f}")
        if train_cfg.save_every and state.step % train_cfg.save_every == 0:
            self.checkpoint()

    def end_epoch(self, before_checkpoint: Callable[[], Any] | None = None) -> None:
        """Epoch-interval decay, validation (best/ when it improves), ``before_checkpoint`` (by the main
        process), a checkpoint."""
        if self.prepared.config.train.scheduler.interval == "epoch":
            with warnings.catch_warnings():
                if self.state.step > 0:
                    # Resumed after an epoch's last step, this process has not stepped the optimizer yet; torch
                    # warns of a skipped learning rate, but the restored schedule is exact. (With no step at all,
                    # the warning stays.)
                    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step",
                                            category=UserWarning)
                self.schedulers["decay"].step()
        self.state.epoch, self.state.consumed = self.state.epoch + 1, 0
        if self.prepared.eval_records:
            run_dir = self.run_dir if self.main else None
            with self.delivered():
                improved = evaluate_epoch(self.prepared, self.model(), run_dir, self.state, self.metrics_log,
                                          self.accelerator, sharded=self.sharded, progress=self.progress)
                if improved and self.run_dir is not None:
                    weights = self.gathered()
                    if self.main:
                        prepared = self.prepared
                        save_model(self.run_dir / layout.BEST, self.model(), prepared.tokenizer, prepared.config,
                                   prepared.info, weights)
            if improved:
                self.state.best_checkpoint = f"step-{self.state.step:07d}"
        self.heap.end_epoch(self.state.epoch, self.state.step, self.metrics_log)
        if before_checkpoint is not None and self.main:
            before_checkpoint()
        self.checkpoint()
        self.accelerator.wait_for_everyone()

    def interrupted(self, signal_name: str, checkpoint: Path | None) -> TrainingInterrupted:
        """The stop every process raises once ``checkpoint`` is written; the main process's line says it for all."""
        self.accelerator.wait_for_everyone()
        return TrainingInterrupted(signal_name, self.state, checkpoint, self.processes, said_here=self.main)

    def patience_ran_out(self) -> bool:
        train_cfg = self.prepared.config.train
        patience = train_cfg.early_stopping_patience
        if patience and self.state.stale_evals >= patience:
            log.info("early stopping: validation %s did not improve for %d evaluations",
                     train_cfg.best_metric, patience)
            return True
        return False

    def checkpoint(self) -> Path | None:
        if self.run_dir is None:
            return None
        self.checkpointed = self.state.step
        prepared = self.prepared
        self.state.log_window = self.logged.state()
        self.state.processes = self.processes
        shards = None
        if self.sharded:  # every process writes its shard (and its average's) into the folder the main one writes
            self.state.optimizer_format = sharding.OPTIMIZER_FORMAT
            shards = partial(sharding.save_shards, self.model(), _torch_optimizer(self.optimizer),
                             average=self.average.by_name if self.average else None)
            if not self.main:
                shards(None)
        with self.full_precision():
            if self.main:
                self.last_checkpoint = save_checkpoint(
                    self.run_dir, self.state, self.model(), prepared.tokenizer, prepared.config, prepared.info,
                    self.optimizer, self.schedulers, prepared.config.train.keep_checkpoints, shards, self.average)
        if self.sharded:
            self.accelerator.wait_for_everyone()  # the folder is in place (or the main process failed)
        return self.last_checkpoint if self.main else None

    def finish(self) -> dict[str, Any]:
        """final/ (by the main process) and the result summary; the trackers' runs end complete after it."""
        self.speedups.finish()
        if self.run_dir is not None:
            prepared, final = self.prepared, self.run_dir / layout.FINAL
            # the same weights, just written (a checkpoint holds the trained weights, not their average)
            if self.checkpointed == self.state.step and not self.sharded and self.average is None:
                if self.main:
                    model_folder_from(self.last_checkpoint, final)
            else:
                with self.averaged():  # the fp32 weights are the model's own once training is over
                    weights = self.gathered()  # every process swaps its shard's average in for it
                    if self.main:
                        save_model(final, self.model(), prepared.tokenizer, prepared.config, prepared.info, weights)
        self.accelerator.wait_for_everyone()
        state = self.state
        result = {"steps": state.step, "first_train_loss": state.first_loss, "final_train_loss": state.last_loss,
                  "best_eval": state.best, "nonfinite_steps": self.guard.bad_steps,
                  "peak_memory_mb": self.peak_memory()}
        self.metrics_log.close()
        return result

    def peak_memory(self) -> float:
        """The highest peak memory of any process (MiB): resident set size on CPU, CUDA's allocation on a GPU."""
        peak = torch.tensor([peak_memory_mb(self.accelerator.device)], device=self.accelerator.device)
        if self.processes > 1:
            peak = self.accelerator.gather(peak).max()
        return round(float(peak), 1)


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def _whole(clip: Callable[[], Any]) -> Callable[[], torch.Tensor]:
    """A clipper whose norm, computed over every process's shards (a replicated DTensor), comes back as a tensor."""
    def clipped() -> torch.Tensor:
        norm = clip()
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return clipped


def _global_count(accelerator: Any, count: int) -> int:
    if accelerator.num_processes == 1:
        return count
    total = accelerator.reduce(torch.tensor(count, device=accelerator.device), "sum")
    return int(total)


def _batch_rows(window: list[dict[str, torch.Tensor]]) -> list[int]:
    return [int(r) for batch in window for r in batch["row"].tolist()]
