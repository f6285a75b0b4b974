"""A .gguf file where a run is expected: ``qatune eval`` and ``qatune generate`` score and ask it as they do a run.

The weights and the tokenizer are read by transformers' GGUF loader (dequantized to float32). What a run's
model folder keeps in config.yaml and qatune.json comes from the file: a file that ``qatune export --gguf``
wrote carries both under qatune's own keys, so its prompt is the run's, exactly; any other file is prompted
through its own chat template (or the plain question/answer template when it has none).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict
from pathlib import Path, PureWindowsPath
from typing import Any

from qatune.config import Config, DataConfig, ModelConfig, validate_config
from qatune.data.templates import PromptTemplate, resolve_template
from qatune.errors import ConfigError, ModelError, RunDirError
from qatune.model import gguf_cache
from qatune.model.folder import LoadedModel, ModelInfo
from qatune.model.sources import load_pretrained, load_tokenizer, model_max_positions, model_source
from qatune.tasks import task_kind

log = logging.getLogger("qatune")

CONFIG_KEY = "qatune.config"
"""The resolved config of the run a file was exported from (YAML text)."""
INFO_KEY = "qatune.model_info"
"""The run's qatune.json (:class:`qatune.model.folder.ModelInfo`, as JSON)."""
FOREIGN_MAX_LENGTH = 2048
"""A file qatune did not write: the longest prompt and answer evaluated (at most its context length)."""


def gguf_path(path: str | Path) -> Path | None:
    """The .gguf file ``path`` names: the file itself, or a folder that is not a run and holds exactly one."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "qatune.json").is_file() and not (path / "run.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise RunDirError(f"{path} holds {len(found)} .gguf files ({', '.join(f.name for f in found[:4])}); "
                              "pass the file itself")
    return None


def metadata(file: Path) -> dict[str, Any]:
    """The file's key/value metadata (strings and numbers; arrays as their length)."""
    try:
        return gguf_cache.metadata(file)
    except (OSError, ValueError) as exc:
        raise RunDirError(f"cannot read {file} as a GGUF file: {str(exc).splitlines()[0] if str(exc) else exc}") \
            from None


def read_gguf_run(file: Path, tokenizer: Any = None) -> tuple[Config, ModelInfo]:
    """The config and prompt info of a .gguf file, as :func:`qatune.model.folder.read_model_folder` gives a
    run's (``tokenizer``: the file's, for a file qatune did not write; loaded here when not given)."""
    values = metadata(file)
    if CONFIG_KEY in values and INFO_KEY in values:
        import yaml

        config = validate_config(yaml.safe_load(values[CONFIG_KEY]), f"{file} ({CONFIG_KEY})")
        known = ModelInfo.__dataclass_fields__
        info = ModelInfo(**{k: v for k, v in json.loads(values[INFO_KEY]).items() if k in known})
        info.lora_base = None  # the adapters are in the weights
        return config, info
    architecture = values.get("general.architecture", "?")
    config = Config(task="generative", model=ModelConfig(name_or_path=str(file)),
                    data=DataConfig(train_file=str(file)))
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model, "generative")
    template = resolve_template(DataConfig(prompt_template="auto"), tokenizer, file.name)
    context = values.get(f"{architecture}.context_length")
    limit = min(int(context), FOREIGN_MAX_LENGTH) if isinstance(context, int) else FOREIGN_MAX_LENGTH
    info = ModelInfo(task="generative", max_length=limit, prompt_template=template.template,
                     answer_prefix=template.answer_prefix)
    return config, info


def load_gguf_run(file: Path, device: str | None = None, convert: bool = True) -> LoadedModel:
    """A .gguf file's model and tokenizer, with its config and prompt info, ready for inference (``convert``:
    kept converted in qatune's cache, :func:`qatune.model.sources.load_tokenizer`)."""
    import torch

    model_config = ModelConfig(name_or_path=str(file))
    tokenizer = load_tokenizer(model_config, "generative", convert)
    config, info = read_gguf_run(file, tokenizer)
    model = load_pretrained(model_config, "generative", tokenizer, convert=convert)
    if model_max_positions(model.config) is not None and info.max_length > model_max_positions(model.config):
        info.max_length = model_max_positions(model.config)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, info=info, folder=file)


def embedded_run(config: Config, info: ModelInfo) -> dict[str, str]:
    """The keys :func:`read_gguf_run` reads back: the run's config (its paths as names: :func:`without_paths`) and
    prompt info, for a file qatune writes."""
    if not task_kind(info.task).writes or info.seq2seq:
        raise ModelError("only a causal language model's run can be written as a GGUF file")
    import yaml

    portable = yaml.safe_dump(without_paths(config.model_dump(mode="json")), sort_keys=False, allow_unicode=True)
    return {CONFIG_KEY: portable, INFO_KEY: json.dumps({**asdict(info), "lora_base": None})}


def without_paths(values: dict[str, Any]) -> dict[str, Any]:
    """A dumped config with each path (a key ending in _file, _dir or _path) cut to its last part: the data
    files' names and the run folder's name stay, where they were on the user's disk does not. A model named by
    a hub id or a packaged name keeps it; one named by a local path keeps the folder's or file's name."""

    def cut(key: str, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: cut(k, v) for k, v in value.items()}
        if not isinstance(value, str) or not key.endswith(("_file", "_dir", "_path")):
            return value
        if key == "name_or_path" and not _local_path(value):
            return value
        return re.split(r"[\\/]", value.rstrip("\\/"))[-1] or value

    return {key: cut(key, value) for key, value in values.items()}


def _local_path(value: str) -> bool:
    return (value.startswith((".", "~", "/", "\\")) or PureWindowsPath(value).is_absolute()
            or Path(value).expanduser().exists())


def exported_prompt(model: ModelConfig) -> PromptTemplate | None:
    """The prompt of the run a .gguf file was exported from, when the model is such a file (None: it is not)."""
    source = model_source(model)
    if not source.is_gguf:
        return None
    values = metadata(Path(source.path) / str(source.gguf_file))
    if INFO_KEY not in values:
        return None
    info = json.loads(values[INFO_KEY])
    return PromptTemplate(info["prompt_template"], info.get("answer_prefix", ""))


def resolve_prompt(data: DataConfig, model: ModelConfig, tokenizer: Any) -> PromptTemplate:
    """The prompt a config trains and evaluates with (:func:`qatune.data.templates.resolve_template`); a file
    ``qatune export --gguf`` wrote is prompted as the run it came from when data.prompt_template is auto or chat
    (its chat template holds that prompt, with the question as the user message)."""
    source = model.name_or_path or "the scratch model"
    if data.prompt_template in ("auto", "chat") and model.name_or_path:
        exported = exported_prompt(model)
        if exported is not None:
            if data.user_template is not None or data.system_prompt is not None:
                log.warning("data.user_template and data.system_prompt are not used: %s is prompted as the run it "
                            "was exported from (set data.prompt_template to change its prompt)", source)
            if exported.uses_context and not data.context_column:
                raise ConfigError(f"{source} was trained with a context in its prompt; set data.context_column, or "
                                  "set data.prompt_template to a prompt without {context}")
            return exported
    return resolve_template(data, tokenizer, source)
