"""The one switch over the speed paths (``train.speedups``) and the object the training loop calls.

``off`` trains through the model's own forward with nothing patched. ``auto`` turns a path on only where it was
measured to help (:func:`auto_verdict`), and then only where its start-up check reproduces the model's own
outputs on the device the run trains on, after the model is placed there, under the precision it computes in.
A list names the paths to use; each still needs its check, wherever the run trains.

The loop calls a :class:`Speedups` at a few named points: :meth:`~Speedups.attach` (patch the model and build
its loss), :meth:`~Speedups.collator`, :meth:`~Speedups.before_forward`, :meth:`~Speedups.after_backward`,
:meth:`~Speedups.after_step`, :meth:`~Speedups.full_precision` (to save or evaluate) and
:meth:`~Speedups.finish`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qatune.model.objectives import CausalLMObjective, is_encoder_decoder
from qatune.speedups import activations, causal, fused_lora, gpt2, malloc_reuse, master_weights
from qatune.speedups.attention import AttentionByWidth, attention_switch
from qatune.speedups.checks import REDUCED_PRECISION_SLACK, forget
from qatune.speedups.clipping import folded_clipper
from qatune.speedups.master_weights import MasterWeights
from qatune.speedups.prefixes import PrefixPlanner
from qatune.speedups.shapes import width_multiple

log = logging.getLogger("qatune")


@dataclass(frozen=True)
class SpeedPath:
    name: str
    what: str


PATHS = (
    SpeedPath("fused_gelu", "transformers' Python tanh-GELU (GPT-2's gelu_new) run as torch's fused kernel"),
    SpeedPath("lora_one_pass", "each LoRA adapter's product added inside its base layer's matrix product, "
                               "forward and backward"),
    SpeedPath("last_column", "a causal batch's last column (it predicts nothing, nothing reads it) left out of "
                             "the forward"),
    SpeedPath("supervised_head", "the LM head and the loss on the supervised positions only"),
    SpeedPath("gpt2_supervised_rows", "GPT-2: the last block on the supervised positions only, the batch's shared "
                                      "prompt prefix computed once"),
    SpeedPath("shared_prefix", "the prompt prefix every row of a batch shares computed once, through the model's "
                               "cache"),
    SpeedPath("prefix_groups", "each group's longer shared prefix (questions about one context) computed once "
                               "per batch"),
    SpeedPath("last_layer_rows", "the last layer's attention output projection and MLP on the supervised "
                                 "positions only"),
    SpeedPath("unpadded_rows", "every layer's projections and MLP on the real tokens only, no padding"),
    SpeedPath("attention_by_width", "eager attention for batches of at most 256 tokens, SDPA for wider ones"),
    SpeedPath("bf16_master_weights", "bf16 on CPU: weights held in bf16, the optimizer updates fp32 master "
                                     "copies (else: autocast over fp32 weights)"),
    SpeedPath("width_rounding", "batch widths rounded up (to a multiple of 2 on a CPU, 32 on a GPU): fewer kernel "
                                "builds"),
    SpeedPath("malloc_reuse", "glibc's malloc keeps freed memory for reuse while training (CPU)"),
    SpeedPath("folded_clipping", "gradient clipping folded into the fused AdamW update"),
)
NAMES = tuple(path.name for path in PATHS)

GPU_NOT_MEASURED = ("measured on a GPU for one small workload only, not yet for a whole run's gain (bench/gpu.sh "
                    "measures them; speedups: all turns them on)")


def auto_verdict(name: str, device_type: str, precision: str) -> str | None:
    """Whether ``auto`` turns a path on where a run trains: None where it was measured to help, else why not."""
    if device_type == "cuda":
        return GPU_NOT_MEASURED
    if device_type != "cpu":
        return f"not measured on {device_type}"
    if name in ("attention_by_width", "width_rounding") and precision != "bf16":
        return "measured faster under bf16 only"
    return None


class Speedups:
    """The speed paths of one training run: which are on and why the others are off, and the calls the loop
    makes. ``setting`` is ``train.speedups``: ``auto``, ``off`` or a list of path names."""

    def __init__(self, setting: str | list[str], precision: str, device: torch.device | str, processes: int = 1,
                 sharded: bool = False):
        self.setting = setting
        self.precision = precision
        self.device = torch.device(device)
        self.processes = processes
        self.reasons: dict[str, str | None] = {}
        """Every path: None where it is on, else why it is off."""
        for name in NAMES:
            if sharded:
                self.reasons[name] = "train.distributed is fsdp, under which no path has been checked yet"
            elif setting == "off":
                self.reasons[name] = "train.speedups is off"
            elif setting == "auto":
                self.reasons[name] = auto_verdict(name, self.device.type, precision)
            else:
                self.reasons[name] = None if name in setting else "not listed in train.speedups"
        self.masters: MasterWeights | None = None
        self.attention: AttentionByWidth | None = None
        self.longest = 0
        self.dropout = False
        self.notes: list[str] = []

    def on(self, name: str) -> bool:
        return self.reasons[name] is None

    def _off(self, name: str, why: str) -> None:
        if self.reasons[name] is None:
            self.reasons[name] = why

    # --- set-up

    def attach(self, model: nn.Module, objective: nn.Module, longest: int = 0) -> nn.Module:
        """Place the model on the run's device, patch it where a path is on (each checked there, under the run's
        precision), and return the loss to train: ``objective`` (the run's kind's, over ``model``) unless a path
        computes the same loss with less work. ``longest``: the longest training row, for the log."""
        self.longest = longest
        model.to(self.device)
        forget(model)
        if self.on("fused_gelu") and not activations.python_gelus(model):
            self._off("fused_gelu", "the model has no Python tanh-GELU")
        if self.on("fused_gelu"):
            activations.fuse_activations(model)
        self._attach_lora(model)
        causal_lm = type(objective) is CausalLMObjective
        if not causal_lm:
            why = ("an encoder-decoder model has no causal LM loss" if is_encoder_decoder(model)
                   else "the run's loss is not a causal LM's")
            for name in causal.CAUSAL_PATHS:
                self._off(name, why)
        if self.on("attention_by_width"):
            switch = attention_switch(model)
            if isinstance(switch, str):
                self._off("attention_by_width", switch)
            else:
                self.attention = switch
        if causal_lm:
            wanted = {name for name in causal.CAUSAL_PATHS if self.on(name)}
            with self._check_precision():
                found = causal.choose(model, wanted, self.attention, self._slack())
            for name, why in found.items():
                if why is not None:
                    self._off(name, why)
            paths = {name for name in causal.CAUSAL_PATHS if self.on(name)}
            if paths:
                objective = causal.SupervisedRowsObjective(model, paths)
            self.dropout = gpt2.has_dropout(model)
        self._attach_masters(model)
        if self.masters is None and self.precision == "bf16" and self.device.type == "cpu":
            self.notes.append("bf16: autocast over fp32 weights")
        if self.on("malloc_reuse"):
            self._reuse_memory()
        return objective

    def _attach_lora(self, model: nn.Module) -> None:
        if not self.on("lora_one_pass"):
            return
        if not fused_lora.layers(model):
            self._off("lora_one_pass", "no LoRA adapters")
            return
        missing = fused_lora.missing_attributes(model)
        if missing:
            import peft

            self._off("lora_one_pass", f"peft {peft.__version__} is older than this path reads (its LoRA layers lack "
                                       f"{', '.join(missing)}); pip install 'peft>=0.18'")
            return
        fused_lora.install(model)

    def _attach_masters(self, model: nn.Module) -> None:
        if not self.on("bf16_master_weights"):
            return
        why = master_weights.applies(self.precision, self.device.type, self.processes)
        if why is not None:
            self._off("bf16_master_weights", why)
        else:
            self.masters = MasterWeights(model)

    def _reuse_memory(self) -> None:
        if self.device.type != "cpu":
            self._off("malloc_reuse", "CPU only")
        elif malloc_reuse.user_settings():
            self._off("malloc_reuse", "glibc's malloc settings are the user's (MALLOC_* or GLIBC_TUNABLES)")
        elif not malloc_reuse.keep_freed_memory():
            self._off("malloc_reuse", "not glibc")

    def _slack(self) -> float:
        """The checks' tolerance factor: they run under the precision the run computes in."""
        reduced = self.precision in ("bf16", "fp16") and self.device.type != "cpu"
        return REDUCED_PRECISION_SLACK if reduced else 1.0

    def _check_precision(self) -> Any:
        """What the checks run under: the run's autocast on a GPU. On a CPU they run in fp32, before
        ``bf16_master_weights`` turns the weights to bf16, as an exact comparison."""
        if self.device.type != "cpu" and self.precision in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
            return torch.autocast(self.device.type, dtype=dtype)
        return nullcontext()

    def collator(self, collator: Any) -> Any:
        """The training collator, with widths rounded and prompt prefixes planned where the loss uses them."""
        if self.on("width_rounding"):
            if hasattr(collator, "pad_to_multiple_of"):
                collator.pad_to_multiple_of = width_multiple(self.device.type)
            else:
                self._off("width_rounding", f"{type(collator).__name__} does not round widths")
        if not hasattr(collator, "uncounted_columns"):
            return collator
        collator.uncounted_columns = 1 if self.on("last_column") else 0
        shared = self.on("shared_prefix") or self.on("gpt2_supervised_rows")
        groups = self.on("prefix_groups")
        return PrefixPlanner(collator, shared, groups) if shared or groups else collator

    def parameters(self, objective: nn.Module) -> Any:
        """What the optimizer updates: the fp32 masters, or the model's trainable parameters."""
        if self.masters is not None:
            return self.masters.masters
        return [p for p in objective.parameters() if p.requires_grad]

    def clipper(self, accelerator: Any, optimizer: Any, max_norm: float | None) -> Callable[[], Any] | None:
        """Clipping folded into the optimizer's update, or None (clip as usual)."""
        if not self.on("folded_clipping"):
            return None
        clip = folded_clipper(accelerator, optimizer, max_norm)
        if isinstance(clip, str):
            self._off("folded_clipping", clip)
            return None
        return clip

    # --- each step

    def before_forward(self, batch: dict[str, Any]) -> None:
        if self.attention is not None:
            self.attention.use(batch["input_ids"].shape[1])

    def after_backward(self) -> None:
        if self.masters is not None:
            self.masters.accumulate()

    def after_step(self) -> None:
        if self.masters is not None:
            self.masters.refresh()

    def full_precision(self) -> Any:
        """The model with its fp32 weights while this is entered (``bf16_master_weights`` trains bf16 ones)."""
        return self.masters.full_precision() if self.masters is not None else nullcontext()

    def named_grads(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        if self.masters is not None:
            return self.masters.named_grads()
        return ((name, p.grad) for name, p in model.named_parameters() if p.grad is not None)

    def finish(self) -> None:
        """Training is over: fp32 weights back in the model, freed memory back to the system."""
        if self.masters is not None:
            self.masters.release()
        if self.on("malloc_reuse"):
            malloc_reuse.hand_back_freed_memory()

    # --- the log

    def describe(self) -> str:
        """One line: which paths are on, and why each other is off."""
        on = [name for name in NAMES if self.on(name)]
        why_off: dict[str, list[str]] = {}  # paths off for the same reason, named together
        for name in NAMES:
            if not self.on(name):
                why_off.setdefault(self.reasons[name] or "", []).append(name)
        off = [f"{', '.join(names)} ({why})" for why, names in why_off.items()]
        setting = self.setting if isinstance(self.setting, str) else "[" + ", ".join(self.setting) + "]"
        head = f"speedups ({setting}): "
        if self.setting == "off":
            text = head + "off: the model's own forward, nothing patched"
        elif not on and len({self.reasons[name] for name in NAMES}) == 1:
            text = head + f"none on: {self.reasons[NAMES[0]]}"
        else:
            text = head + "on: " + (", ".join(on) or "none") + "; off: " + "; ".join(off)
        notes = list(self.notes)
        if self.attention is not None:
            notes.append("attention: " + self.attention.describe(self.longest))
        if self.dropout and any(self.on(name) for name in ("shared_prefix", "prefix_groups", "gpt2_supervised_rows")):
            notes.append("prompt prefixes are not shared while dropout is active")
        return text + "".join(f"; {note}" for note in notes)


def evaluation_loss(model: nn.Module, collator: Any, setting: str | list[str] = "auto"
                     ) -> tuple[nn.Module, Any]:
    """The loss and collator that evaluate a causal LM's held-out rows: with the exact paths of ``setting`` (a
    run's ``train.speedups``) that apply where the model is, and the prompt prefixes they share planned."""
    weight = next(model.parameters())
    speedups = Speedups(setting, "fp32", weight.device)
    wanted = {name for name in causal.CAUSAL_PATHS if speedups.on(name)}
    if not wanted or not isinstance(getattr(collator, "uncounted_columns", None), int):
        return CausalLMObjective(model), collator
    found = causal.choose(model, wanted, None)
    for name, why in found.items():
        if why is not None:
            speedups._off(name, why)
    paths = {name for name in causal.CAUSAL_PATHS if speedups.on(name)}
    if not paths:
        return CausalLMObjective(model), collator
    return causal.SupervisedRowsObjective(model, paths), speedups.collator(collator)


def for_inference(model: nn.Module, setting: str | list[str] = "auto") -> nn.Module:
    """A loaded model prepared for evaluation and generation: ``fused_gelu`` where ``setting`` turns it on."""
    weight = next(model.parameters(), None)
    device = weight.device if weight is not None else torch.device("cpu")
    if Speedups(setting, "fp32", device).on("fused_gelu"):
        activations.fuse_activations(model)
    return model
