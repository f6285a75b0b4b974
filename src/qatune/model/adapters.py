"""LoRA adapters (peft) on a loaded model: which weights train, and where a run keeps the base they sit on."""

from __future__ import annotations

from typing import Any

from qatune.config import ModelConfig
from qatune.errors import ModelError
from qatune.model.families import family_of
from qatune.model.sources import model_source
from qatune.tasks import task_kind


def apply_lora(model: Any, lora: Any, task: str) -> Any:
    """Wrap a model with LoRA adapters; only the adapters (and a QA head) are trained. Without
    ``lora.target_modules`` they go on the modules the model's family names (peft's default for a family qatune does
    not know)."""
    try:
        from peft import LoraConfig, TaskType, get_peft_model
    except ImportError:
        raise ModelError("model.lora needs the peft library: pip install 'qatune[lora]'") from None
    kind = task_kind(task)
    seq2seq = kind.writes and model.config.is_encoder_decoder
    task_type = TaskType.SEQ_2_SEQ_LM if seq2seq else TaskType[kind.peft_task_type]
    settings = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=lora.target_modules or _family_targets(model), task_type=task_type,
                          layers_to_transform=_last_layers(model, lora.last_layers))
    try:
        return get_peft_model(model, settings)
    except ValueError as exc:
        raise ModelError(f"model.lora: {str(exc).splitlines()[0]}; set model.lora.target_modules to some of "
                         f"{_weight_layers(model)[:30]}") from None


def _family_targets(model: Any) -> list[str] | None:
    family = family_of(model.config)
    return list(family.lora_targets) if family is not None else None


def _weight_layers(model: Any) -> list[str]:
    """The names of the modules LoRA can adapt: those that hold a weight matrix themselves (linear layers,
    GPT-2's Conv1D, embeddings), not their containers."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if name and not next(module.children(), None)
                   and getattr(getattr(module, "weight", None), "ndim", 0) == 2})


def _last_layers(model: Any, last: int | None) -> list[int] | None:
    """The indices of the model's last ``last`` transformer layers (None: every layer)."""
    if last is None:
        return None
    count = model.config.get_text_config().num_hidden_layers
    if last > count:
        raise ModelError(f"model.lora.last_layers is {last}, but the model has {count} layers")
    return list(range(count - last, count))


def lora_base_in_run(model: ModelConfig) -> bool:
    """LoRA whose base weights are saved in RUN/base: on a scratch model, and on a GGUF file (so that eval
    and generate read a plain safetensors base and need neither the file nor the gguf package)."""
    return model.scratch is not None or (model.name_or_path is not None and model_source(model).is_gguf)
