"""The NaN guard: a step whose loss or gradient norm is not finite is never applied, and is explained."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from pathlib import Path

import torch

from qatune.errors import row_list
from qatune.runs import atomic, layout

log = logging.getLogger("qatune")

MAX_SCALE_SKIPS = 25
"""fp16: overflowing steps in a row that the loss scaler may skip before they count as non-finite."""


class NonFiniteGuard:
    """Every optimizer step: loss and gradient norm must be finite, from step 1.

    A bad step is never applied. Its diagnosis (rows of the batch, lr, per-layer gradient norms,
    largest logits, precision) goes to the console and to RUN/nonfinite-step-N.json.
    """

    def __init__(self, run_dir: Path | None, policy: str, limit: int, precision: str,
                 bad_steps: list[int] | None = None):
        self.run_dir = run_dir
        self.policy = policy
        self.limit = limit
        self.precision = precision
        self.bad_steps: list[int] = bad_steps if bad_steps is not None else []
        self.in_a_row = 0
        self.scale_skips = 0

    def ok(self) -> None:
        self.in_a_row = 0
        self.scale_skips = 0

    def scale_skip(self) -> bool:
        """fp16: the loss scaler skipped an overflowing update; True while that is still normal."""
        self.scale_skips += 1
        return self.scale_skips < MAX_SCALE_SKIPS

    def record(self, step: int, epoch: int, loss: float, grad_norm: float, rows: list[int], lr: float,
               grads: Iterable[tuple[str, torch.Tensor]], logit_absmax: float) -> None:
        """A bad step: ``grads`` are the step's (parameter name, gradient) pairs."""
        self.bad_steps.append(step)
        self.in_a_row += 1
        norms = {name: float(grad.detach().float().norm()) for name, grad in grads}
        worst = sorted(norms.items(), key=lambda kv: -kv[1] if math.isfinite(kv[1]) else -math.inf)
        non_finite_layers = [name for name, value in norms.items() if not math.isfinite(value)]
        diagnosis = {
            "step": step, "epoch": epoch, "loss": loss, "grad_norm": grad_norm, "rows": rows, "lr": lr,
            "precision": self.precision, "largest_abs_logit": logit_absmax,
            "non_finite_grad_layers": non_finite_layers[:50], "largest_grad_norms": dict(worst[:10]),
            "likely_causes": likely_causes(loss, grad_norm, lr, logit_absmax, self.precision),
        }
        if self.run_dir is not None:
            atomic.atomic_write_text(layout.nonfinite_report(self.run_dir, step),
                                     json.dumps(diagnosis, indent=2, default=str) + "\n")
        log.warning("non-finite step %d (loss=%s, grad_norm=%s, lr=%.3g): update not applied; batch rows %s; %s",
                    step, loss, grad_norm, lr, row_list(rows), diagnosis["likely_causes"][0])

    def should_stop(self) -> bool:
        if self.policy == "stop":
            return len(self.bad_steps) >= self.limit
        return self.in_a_row >= self.limit

    def stop_message(self) -> str:
        causes = likely_causes(math.nan, math.nan, 0.0, 0.0, self.precision)
        where = f"; diagnosis in {self.run_dir}/nonfinite-step-*.json" if self.run_dir else ""
        return (f"training stopped: {len(self.bad_steps)} non-finite step(s) (steps {self.bad_steps[:10]}), "
                f"train.on_nonfinite={self.policy}{where}. Likely causes, in order: " + "; ".join(causes))


def likely_causes(loss: float, grad_norm: float, lr: float, logit_absmax: float, precision: str) -> list[str]:
    causes = []
    if not math.isfinite(logit_absmax) or logit_absmax > 1e4:
        causes.append("the forward pass overflowed (huge or non-finite logits): lower train.learning_rate, "
                      "check the data for extreme inputs")
    if precision == "fp16":
        causes.append("fp16 overflows easily: use train.precision: bf16 or fp32")
    if lr > 1e-3:
        causes.append(f"learning rate {lr:.3g} is high for fine-tuning: lower train.learning_rate and keep "
                      "train.max_grad_norm set")
    causes.append("a batch with no supervised tokens or broken labels: run 'qatune check --config ...'")
    causes.append("too high a learning rate without warmup: set train.warmup_steps and train.max_grad_norm")
    return causes
