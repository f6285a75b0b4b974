"""A trained model's folder on disk: RUN/final, RUN/best and the model files of every checkpoint.

A model folder is a save_pretrained folder (safetensors weights, tokenizer) plus config.yaml and
``qatune.json`` (:class:`ModelInfo`: the task, the prompt template, max_length and doc_stride),
so eval and generate need nothing else. :func:`load_model_folder` reads one back for inference, LoRA
adapters merged into their base; :func:`export_merged` writes it out as a plain transformers folder.
Where folders live in a run directory is :mod:`qatune.runs.layout`'s.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qatune.config import Config, validate_config
from qatune.data.grading_fields import FieldSpec
from qatune.errors import ModelError, RunDirError
from qatune.model.packaged import resolve_model_path
from qatune.model.sources import auto_class, prepare_tokenizer, quiet_transformers
from qatune.runs import atomic, layout
from qatune.tasks import task_kind


@dataclass
class ModelInfo:
    """What eval and generate need besides weights and tokenizer (saved as qatune.json)."""

    task: str
    max_length: int
    prompt_template: str = "Question: {question}\nAnswer:"
    answer_prefix: str = " "
    doc_stride: int = 128
    qatune_version: str = ""
    seq2seq: bool = False
    """Generative QA with an encoder-decoder (T5-style): prompt in, answer out."""
    lora_base: str | None = None
    """LoRA runs: the base model (a hub id, a folder, or "base" for RUN/base); the folder holds the adapter."""
    answer_fields: dict[str, str] | None = None
    """Runs with data.answer_columns: each answer column and how it is scored (number, label or text), in the
    order of the answer; eval and generate parse the answers back into these columns."""
    answer_template: str | None = None
    """Runs with data.answer_columns: the template the answers were written with (data.answer_template resolved)."""
    scoring_heads: list[dict] | None = None
    """Scoring runs: each answer column's head in the model's output layer (HeadLayout.to_json)."""
    field_specs: dict[str, dict] | None = None
    """Runs with data.answer_columns: each answer column as training saw it (FieldSpec.to_json: its classes or
    values, a number's decimal separator, range and tolerance), so that every evaluation reads it alike."""
    grounding: dict | None = None
    """Generative runs with a context: how their training answers relate to their passages (PassageAnswers.to_json:
    the share that are spans, the no-answer text, and what generate.grounded auto decided)."""

    def specs(self) -> dict[str, FieldSpec] | None:
        """Each answer field as training saw it; a run saved before field specs were kept has its fields' kinds
        only. None for runs without answer fields."""
        if not self.answer_fields:
            return None
        saved = self.field_specs or {}
        return {name: FieldSpec.from_json(saved[name]) if name in saved else FieldSpec(kind)
                for name, kind in self.answer_fields.items()}

    def save(self, folder: Path) -> None:
        (folder / layout.MODEL_INFO).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, folder: Path) -> ModelInfo:
        data = json.loads((folder / layout.MODEL_INFO).read_text(encoding="utf-8"))
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def save_model(folder: Path, model: Any, tokenizer: Any, config: Config, info: ModelInfo,
               weights: dict[str, Any] | None = None) -> Path:
    """Write a self-contained model folder atomically: a crash never leaves a half-written one. ``weights``: the
    model's state gathered whole, where the model itself holds a shard of it (train.distributed fsdp)."""
    size = sum(t.numel() * t.element_size() for t in (weights or model.state_dict()).values())
    return atomic.write_folder(Path(folder), lambda tmp: write_model_files(tmp, model, tokenizer, config, info,
                                                                           weights), size_hint=size)


def write_model_files(folder: Path, model: Any, tokenizer: Any, config: Config, info: ModelInfo,
                      weights: dict[str, Any] | None = None, with_weights: bool = True) -> None:
    """Weights (safetensors), tokenizer, the resolved config and qatune.json into ``folder``. ``weights``: the
    model's weights gathered whole (a sharded model); ``with_weights`` False: the model's config (or its LoRA
    adapter's) without the weights."""
    if not with_weights:
        _write_model_config(folder, model)
    else:
        # save_pretrained empties the state dict it is given: it gets a copy of the mapping (the tensors are shared).
        given = {"state_dict": dict(weights)} if weights is not None else {}
        model.save_pretrained(folder, safe_serialization=True, **given, **_save_format(model))
    tokenizer.save_pretrained(folder)
    (folder / layout.CONFIG).write_text(config.to_yaml(), encoding="utf-8")
    info.save(folder)


def _write_model_config(folder: Path, model: Any) -> None:
    peft_config = getattr(model, "peft_config", None)
    if peft_config:
        peft_config[model.active_adapter].save_pretrained(folder)
        return
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


NO_WEIGHT_CONVERSIONS = ("GPT2LMHeadModel", "T5ForConditionalGeneration", "BertForQuestionAnswering")
"""The classes qatune builds from scratch: transformers renames or converts none of their weights on saving
(tests/unit/test_model.py checks it against the installed transformers)."""


def _save_format(model: Any) -> dict[str, Any]:
    """save_pretrained's arguments for ``model``. A model that transformers loaded carries the weight
    conversions it applied; one built from a config carries none, and save_pretrained then builds its table of
    every architecture's conversions (900 regular expressions compiled on the first save in a process) only to
    find no entry. For a class known to have none, skipping that lookup writes the same files."""
    if type(model).__name__ in NO_WEIGHT_CONVERSIONS and getattr(model, "_weight_conversions", None) is None:
        return {"save_original_format": False}
    return {}


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    config: Config
    info: ModelInfo
    folder: Path


def load_model_folder(path: str | Path, which: str = layout.FINAL, device: str | None = None) -> LoadedModel:
    """Load a trained model with its tokenizer, config and prompt info, ready for inference."""
    import torch
    from transformers import AutoTokenizer

    folder = layout.find_model_folder(path, which)
    problem = atomic.damage(folder)
    if problem:
        raise RunDirError(f"the model in {folder} is damaged: {problem}; train again, or use another of the run's "
                          "model folders (--model best, or a checkpoint)")
    config, info = read_model_folder(folder)
    auto = _ScoringLoader if task_kind(info.task).scores else auto_class(info.task, info.seq2seq)
    quiet_transformers()
    trust = config.model.trust_remote_code
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust)
        if (folder / layout.SHARDS).is_dir():
            model = _load_sharded(folder, auto, trust)
        elif (folder / "adapter_config.json").is_file():
            model = _load_lora(folder, info, auto, trust)
        else:
            model = auto.from_pretrained(folder, trust_remote_code=trust, use_safetensors=True)
    except (OSError, ValueError) as exc:
        raise RunDirError(f"cannot load the model in {folder}: {str(exc).splitlines()[0]}") from None
    tokenizer = prepare_tokenizer(tokenizer, info.task, str(folder))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, info=info, folder=folder)


class _ScoringLoader:
    """A scoring model's folder read back as transformers' classes are (either of its layouts)."""

    @staticmethod
    def from_pretrained(folder: Path, trust_remote_code: bool = False, **_: Any) -> Any:
        from qatune.model.scoring import load_scoring_model

        return load_scoring_model(Path(folder), trust_remote_code)


def read_model_folder(folder: Path) -> tuple[Config, ModelInfo]:
    """The resolved config and qatune.json of a model folder, each failure naming its file."""
    import yaml

    try:
        raw = yaml.safe_load((folder / layout.CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise RunDirError(f"cannot read {folder / layout.CONFIG}: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise RunDirError(f"{folder / layout.CONFIG} does not hold a qatune config")
    config = validate_config(raw, str(folder / layout.CONFIG))
    try:
        info = ModelInfo.load(folder)
    except (OSError, ValueError, TypeError) as exc:
        raise RunDirError(f"cannot read {folder / layout.MODEL_INFO}: {exc}") from None
    return config, info


def _load_sharded(folder: Path, auto: Any, trust: bool) -> Any:
    """A checkpoint of a run with train.distributed fsdp: the model built from its config, its weights read from the
    processes' shards in this one process."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig

    if (folder / "adapter_config.json").is_file():
        raise RunDirError(f"{folder} is a checkpoint of a LoRA run sharded with train.distributed fsdp: it holds the "
                          "adapters in shards for resuming; evaluate the run's final/ or best/ (or resume it)")
    model = auto.from_config(AutoConfig.from_pretrained(folder, trust_remote_code=trust), trust_remote_code=trust)
    tied = _tied_copies(model)
    weights = {name: w for name, w in model.state_dict().items() if name not in tied}
    with warnings.catch_warnings():  # torch warns of the single process that no_dist asks for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load({"model": weights}, checkpoint_id=str(folder / layout.SHARDS), no_dist=True)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    return model


def _tied_copies(model: Any) -> set[str]:
    """State-dict names of weights that are another, earlier one (an output layer tied to the embeddings)."""
    seen: dict[int, str] = {}
    copies = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            copies.add(name)
        seen.setdefault(id(tensor), name)
    return copies


def _load_lora(folder: Path, info: ModelInfo, auto: Any, trust: bool) -> Any:
    """Base model + the folder's adapter, merged into plain weights for fast inference."""
    try:
        from peft import PeftModel
    except ImportError:
        raise ModelError("this run holds LoRA adapters; loading them needs: pip install 'qatune[lora]'") from None
    if not (folder / "adapter_model.safetensors").is_file():
        raise RunDirError(f"{folder} has LoRA adapters but no adapter_model.safetensors; qatune loads safetensors only")
    base = lora_base_path(folder, info)
    model = auto.from_pretrained(resolve_model_path(base), trust_remote_code=trust, use_safetensors=True)
    # The adapter file was checked above: peft reads adapter_model.safetensors when it exists.
    return PeftModel.from_pretrained(model, folder).merge_and_unload()


def lora_base_path(folder: Path, info: ModelInfo) -> str:
    if info.lora_base != layout.BASE:
        return info.lora_base or ""
    base = layout.find_lora_base(folder)
    if base is None:
        raise RunDirError(f"{folder} holds LoRA adapters, but their base model ({layout.BASE}/) is not in its run "
                          "directory; copy the whole run directory, not only the model folder")
    return str(base)
