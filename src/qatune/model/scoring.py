"""Scoring models (``task: scoring``): a pretrained backbone reads a row's text (question, reference answer,
student answer, any column) and one linear layer over its pooled output holds a head per answer column: a
softmax over the column's labels for a label column, one value for a number column.

The heads are slices of one output layer, laid out by :class:`HeadLayout`. With ``model.pooling: auto`` the
model is transformers' own ``AutoModelForSequenceClassification`` of the backbone (first token through the
encoder's pooler for BERT-like encoders, the last token for decoders), so ``final/`` is a plain folder of that
class, and with a single label column ``transformers.pipeline("text-classification")`` reads it as it is; with
``mean``, :class:`MeanPooledScorer` averages the encoder's last hidden states over the row's tokens.

A number column's head is one of two kinds (``model.number_head``). ``regression``: one output trained on the
column's own scale, its training range mapped to -1..1 (:meth:`HeadLayout.scaled`), with an absolute-error loss
(its best guess is the middle of what it could be, as the error is measured), and predicted back on the column's
scale, clamped to the range, as the nearest of the values training saw. ``values``: a softmax over the values
training saw, trained with cross-entropy (a value training never saw counts as its nearest), and predicted as the
median of that distribution: the value whose expected absolute error is least. A label column is trained with
cross-entropy, each class weighed as ``data.class_weights`` says (:func:`class_weights`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qatune.data.grading_fields import FieldSpec, format_value
from qatune.data.numbers import parse_number
from qatune.data.padding import IGNORE_INDEX

SCORED_KINDS = ("label", "number")
POOLING = ("auto", "mean")
MEAN_POOLED_FILE = "scoring.json"
"""Beside the weights of a mean-pooled scorer: its backbone's class and the width of its output layer."""


@dataclass(frozen=True)
class Head:
    name: str
    kind: str
    start: int
    width: int
    classes: tuple[str, ...] = ()
    low: float = 0.0
    high: float = 0.0
    decimal: str = "."
    by_values: bool = False
    """A number head that chooses among the values training saw (a softmax over ``classes``), not a regression."""
    class_weights: tuple[float, ...] = ()
    """A label head's loss weight for each class (empty: 1 for each)."""

    @property
    def stop(self) -> int:
        return self.start + self.width

    @property
    def is_softmax(self) -> bool:
        return self.kind == "label" or self.by_values

    def numbers(self) -> list[float]:
        """A number head's training values as numbers (ascending, as ``classes`` holds them)."""
        return [parse_number(value, self.decimal) for value in self.classes]


def class_weights(counts: tuple[int, ...], rule: str) -> tuple[float, ...]:
    """Each class's loss weight from its training rows: ``none`` 1 for each; ``balanced`` inversely to its count
    (every class weighs as much in total); ``sqrt`` inversely to the square root of its count. Scaled so that the
    training rows' mean weight is 1, so that the loss keeps its size and the learning rate its meaning."""
    if rule == "none" or not counts:
        return ()
    power = 1.0 if rule == "balanced" else 0.5
    raw = [count ** -power if count else 0.0 for count in counts]
    mean = sum(r * c for r, c in zip(raw, counts)) / sum(counts)
    return tuple(round(r / mean, 6) for r in raw)


@dataclass(frozen=True)
class HeadLayout:
    """The heads of a scoring model in its one output layer, in the order of the answer columns."""

    heads: tuple[Head, ...]

    @classmethod
    def from_specs(cls, specs: dict[str, FieldSpec], number_head: str = "regression",
                   weights: str = "none") -> HeadLayout:
        """The heads of ``specs``' columns; ``number_head``: model.number_head, ``weights``: data.class_weights."""
        heads, start = [], 0
        for name, spec in specs.items():
            if spec.kind == "label":
                head = Head(name, "label", start, len(spec.values), spec.values,
                            class_weights=class_weights(spec.counts, weights))
            else:
                by_values = number_head == "values" and len(spec.values) > 1
                head = Head(name, "number", start, len(spec.values) if by_values else 1, spec.values,
                            low=spec.low or 0.0, high=spec.high or 0.0, decimal=spec.decimal, by_values=by_values)
            heads.append(head)
            start += head.width
        return cls(tuple(heads))

    @property
    def width(self) -> int:
        return sum(head.width for head in self.heads)

    def labels(self) -> dict[int, str]:
        """Each output's name: a label column's outputs its labels (``column=label`` with several columns), a
        number column's its name; with one label column alone, its labels (what a text-classification pipeline
        reports)."""
        names = {}
        for head in self.heads:
            for index in range(head.width):
                if head.by_values:
                    names[head.start + index] = f"{head.name}={head.classes[index]}"
                elif head.kind == "number":
                    names[head.start] = head.name
                elif len(self.heads) == 1:
                    names[head.start + index] = head.classes[index]
                else:
                    names[head.start + index] = f"{head.name}={head.classes[index]}"
        return names

    def targets(self, values: dict[str, str], specs: dict[str, FieldSpec]) -> list[float]:
        """One row's targets, a float per head: a label's class index (IGNORE_INDEX for a label training never
        had, or none), a number on the trained scale (NaN for none), or for a head choosing among values, the index
        of the training value nearest the number (IGNORE_INDEX for none)."""
        out = []
        for head in self.heads:
            text = values.get(head.name)
            if head.kind == "label":
                label = specs[head.name].label(text)
                out.append(float(head.classes.index(label)) if label in head.classes else float(IGNORE_INDEX))
                continue
            number = specs[head.name].number(text)
            if head.by_values:
                out.append(float(IGNORE_INDEX) if number is None else float(_nearest(head.numbers(), number)))
            else:
                out.append(self.scaled(head, number) if number is not None else math.nan)
        return out

    @staticmethod
    def scaled(head: Head, value: float) -> float:
        """A number on the scale its head is trained on: the training range mapped to -1..1."""
        middle, half = (head.high + head.low) / 2, (head.high - head.low) / 2 or 1.0
        return (value - middle) / half

    @staticmethod
    def unscaled(head: Head, value: float) -> float:
        """A head's output back on its column's scale, clamped to the training range."""
        middle, half = (head.high + head.low) / 2, (head.high - head.low) / 2 or 1.0
        return min(max(middle + value * half, head.low), head.high)

    def values(self, outputs: torch.Tensor) -> list[dict[str, str]]:
        """Each row's predicted values as text, from the output layer's (rows, width) outputs: a label column's
        most likely label; a number column's training value nearest the head's output (as written in training: a
        grade on the sheet's own scale), or the output itself, rounded, for a column trained without values; for a
        head choosing among values, the median of its distribution over them."""
        outputs = outputs.float().cpu()
        rows: list[dict[str, str]] = [{} for _ in range(outputs.shape[0])]
        for head in self.heads:
            part = outputs[:, head.start:head.stop]
            numbers = head.numbers()
            if head.by_values:
                # the median: the first value at which the cumulative probability reaches one half
                below = torch.softmax(part, dim=-1).cumsum(dim=-1)
                chosen = (below < 0.5).sum(dim=-1).clamp(max=head.width - 1)
            for index, (row, scores) in enumerate(zip(rows, part)):
                if head.kind == "label":
                    row[head.name] = head.classes[int(scores.argmax())]
                    continue
                if head.by_values:
                    row[head.name] = head.classes[int(chosen[index])]
                    continue
                value = self.unscaled(head, float(scores[0]))
                if numbers:
                    row[head.name] = head.classes[_nearest(numbers, value)]
                else:
                    text = format_value(round(value, 4))
                    row[head.name] = text.replace(".", ",") if head.decimal == "," else text
        return rows

    def to_json(self) -> list[dict[str, Any]]:
        return [{"name": h.name, "kind": h.kind, "start": h.start, "width": h.width, "classes": list(h.classes),
                 "low": h.low, "high": h.high, "decimal": h.decimal, "by_values": h.by_values,
                 "class_weights": list(h.class_weights)} for h in self.heads]

    @classmethod
    def from_json(cls, data: list[dict[str, Any]]) -> HeadLayout:
        return cls(tuple(Head(d["name"], d["kind"], d["start"], d["width"], tuple(d["classes"]), d["low"], d["high"],
                              d["decimal"], d.get("by_values", False), tuple(d.get("class_weights", ())))
                         for d in data))


def _nearest(numbers: list[float], value: float) -> int:
    return min(range(len(numbers)), key=lambda i: abs(numbers[i] - value))


def scoring_loss(outputs: torch.Tensor, targets: torch.Tensor, layout: HeadLayout,
                 weights: dict[str, float] | None = None) -> torch.Tensor:
    """Summed over rows: each row's heads' losses, weighted (``weights``, 1 when missing). A label head's is the
    cross-entropy of its class (none for a label training never had), times its class's weight; a number head's
    the absolute error on its trained scale (none without a number), or the cross-entropy of its nearest training
    value for a head choosing among values."""
    weights = weights or {}
    total = outputs.new_zeros((), dtype=torch.float32)
    for index, head in enumerate(layout.heads):
        part = outputs[:, head.start:head.stop].float()
        target = targets[:, index]
        if head.is_softmax:
            per_class = part.new_tensor(head.class_weights) if head.class_weights else None
            loss = F.cross_entropy(part, target.long(), weight=per_class, ignore_index=IGNORE_INDEX, reduction="sum")
        else:
            known = ~torch.isnan(target)
            loss = (part[known, 0] - target[known]).abs().sum()
        total = total + weights.get(head.name, 1.0) * loss
    return total


class ScoringObjective(nn.Module):
    """The scoring loss through the model's own forward: summed over rows, counted in rows."""

    def __init__(self, model: nn.Module, layout: HeadLayout, weights: dict[str, float] | None = None):
        super().__init__()
        self.model = model
        self.layout = layout
        self.weights = dict(weights or {})

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor, **_: Any
                ) -> dict[str, torch.Tensor]:
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        loss_sum = scoring_loss(outputs, targets, self.layout, self.weights)
        return {"loss_sum": loss_sum, "count": torch.tensor(targets.shape[0], device=outputs.device),
                "logit_absmax": outputs.detach().abs().max()}


class MeanPooledScorer(nn.Module):
    """A backbone (transformers' AutoModel) whose last hidden states are averaged over each row's tokens, and one
    output layer over the average. Saved as the backbone's config.json, model.safetensors (backbone.* and head.*)
    and scoring.json."""

    def __init__(self, backbone: nn.Module, width: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.config.hidden_size, width)
        self._no_split_modules = getattr(backbone, "_no_split_modules", None)

    @property
    def config(self) -> Any:
        return self.backbone.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_: Any) -> SimpleNamespace:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return SimpleNamespace(logits=self.head(pooled))

    def tie_weights(self) -> None:
        """Nothing is tied (what the loop calls on a transformers model after loading weights)."""

    @property
    def supports_gradient_checkpointing(self) -> bool:
        return bool(getattr(self.backbone, "supports_gradient_checkpointing", False))

    def activation_checkpointing_enable(self, **kwargs: Any) -> None:
        """train.activation_checkpointing: the backbone's blocks recompute their activations in the backward pass."""
        self.backbone.activation_checkpointing_enable(**kwargs)

    def save_pretrained(self, folder: str | Path, state_dict: dict[str, torch.Tensor] | None = None,
                        **_: Any) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backbone.config.save_pretrained(folder)
        weights = state_dict if state_dict is not None else self.state_dict()
        save_file({name: tensor.detach().contiguous().cpu() for name, tensor in weights.items()},
                  str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / MEAN_POOLED_FILE).write_text(json.dumps({"pooling": "mean", "width": self.head.out_features,
                                                           "backbone": type(self.backbone).__name__}) + "\n")

    @classmethod
    def from_folder(cls, folder: str | Path, trust_remote_code: bool = False) -> MeanPooledScorer:
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModel

        folder = Path(folder)
        saved = json.loads((folder / MEAN_POOLED_FILE).read_text(encoding="utf-8"))
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        model = cls(AutoModel.from_config(config, trust_remote_code=trust_remote_code), saved["width"])
        model.load_state_dict(load_file(folder / "model.safetensors"))
        return model


def is_mean_pooled(folder: str | Path) -> bool:
    return (Path(folder) / MEAN_POOLED_FILE).is_file()


def classification_config(config: Any, layout: HeadLayout, pad_token_id: int | None,
                          weights: dict[str, float] | None = None) -> Any:
    """A backbone's transformers config set for its sequence-classification class with ``layout``'s outputs; the
    layout itself (``qatune_heads``) and the heads' loss weights (``qatune_field_weights``) saved in it, so that a
    model folder says what each output is."""
    config.qatune_heads = layout.to_json()
    config.qatune_field_weights = dict(weights or {})
    config.num_labels = layout.width
    config.id2label = layout.labels()
    config.label2id = {name: index for index, name in config.id2label.items()}
    only_labels = all(head.kind == "label" for head in layout.heads) and len(layout.heads) == 1
    config.problem_type = "single_label_classification" if only_labels else None
    if pad_token_id is not None:  # a decoder's classification reads the last token that is not this one
        config.pad_token_id = pad_token_id
    return config


def build_scoring_model(model_config_section: Any, tokenizer: Any, layout: HeadLayout, model_config: Any = None,
                        scratch: Any = None, weights: dict[str, float] | None = None) -> nn.Module:
    """A scoring model over a pretrained backbone (``model_config_section``: the config's model section) or a
    scratch one (``scratch``: model.scratch), with ``layout``'s outputs, pooled as model.pooling says; ``weights``:
    data.field_weights."""
    from qatune.model.sources import build_scratch, load_pretrained

    def configured(config: Any) -> Any:
        return classification_config(config, layout, tokenizer.pad_token_id, weights)

    mean = model_config_section.pooling == "mean"
    if scratch is not None:
        model = build_scratch(scratch, "scoring", tokenizer, configured)
        return MeanPooledScorer(model.base_model, layout.width) if mean else model
    if mean:
        from transformers import AutoModel

        backbone = load_pretrained(model_config_section, "scoring", tokenizer, configured(model_config), auto=AutoModel)
        return MeanPooledScorer(backbone, layout.width)
    return load_pretrained(model_config_section, "scoring", tokenizer, configured(model_config))


def scoring_objective(model: nn.Module) -> ScoringObjective:
    """The training loss of a scoring model, its heads and their weights read from its config."""
    config = model.config
    return ScoringObjective(model, HeadLayout.from_json(config.qatune_heads), getattr(config, "qatune_field_weights",
                                                                                     None))


def load_scoring_model(folder: Path, trust_remote_code: bool = False) -> nn.Module:
    """A trained scoring model's folder read back (either layout)."""
    if is_mean_pooled(folder):
        return MeanPooledScorer.from_folder(folder, trust_remote_code)
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=trust_remote_code,
                                                              use_safetensors=True)
