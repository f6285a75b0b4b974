"""Reading a config: defaults < YAML < ``--set key=value``, every problem reported at once.

Each problem names its key and what would fix it; checks that span keys (a model named and a scratch one
too, a template that uses a column nobody set) come after the types.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from qatune.config.columns import column_key, template_fields
from qatune.config.sections import Config, DataConfig, Section, section_class
from qatune.errors import ConfigError
from qatune.tasks import task_kind


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
    value = _override_value(key, text)
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


TEXT_ESCAPES = ("data.prompt_template", "data.user_template", "data.system_prompt", "data.answer_template")
"""Keys whose text typed after --set may carry \\n and \\t (a template's line breaks), as in a YAML "..." string."""


def _override_value(key: str, text: str) -> Any:
    """The value of ``--set key=text``. YAML reads numbers, booleans, null, lists and mappings; but for a key that
    takes text, text is kept as typed (``|``, ``>``, ``#``, ``!``, ``{question}`` or ``Q: {question}`` would
    otherwise be read by YAML as something else: an empty block, a comment, a tag, a mapping), unless quoted."""
    stripped = text.strip()
    try:
        value = yaml.safe_load(text) if stripped else None
    except yaml.YAMLError:
        value = text
    kinds = _accepted_kinds(key.split("."))
    if "str" not in kinds or (value is None and stripped in ("", "~", "null", "Null", "NULL")):
        return value
    if stripped[:1] in ("'", '"') and isinstance(value, str):
        return value
    if value is not None and not isinstance(value, str) and type(value).__name__ in kinds:
        return value
    if key in TEXT_ESCAPES:
        stripped = stripped.replace("\\n", "\n").replace("\\t", "\t")
    return stripped


def _accepted_kinds(parts: list[str]) -> set[str]:
    """What the config key ``parts`` takes: some of str, int, float, bool, list, dict, NoneType (empty if unknown)."""
    section = _section_at(tuple(parts[:-1]))
    if section is None or parts[-1] not in section.model_fields:
        return set()
    kinds: set[str] = set()
    pending = [section.model_fields[parts[-1]].annotation]
    while pending:
        current = pending.pop()
        origin = typing.get_origin(current)
        if origin is Literal:
            kinds.update(type(choice).__name__ for choice in typing.get_args(current))
        elif origin in (list, tuple, set):
            kinds.add("list")
        elif origin is dict or (isinstance(current, type) and issubclass(current, (dict, Section))):
            kinds.add("dict")
        elif origin is not None:  # a union (X | None), Annotated
            pending.extend(typing.get_args(current))
        elif isinstance(current, type):
            kinds.add("str" if issubclass(current, (str, Path)) else current.__name__)
    return kinds


def _section_at(loc: tuple[Any, ...]) -> type[Section] | None:
    section: type[Section] | None = Config
    for part in loc:
        if section is None or part not in section.model_fields:
            return None
        section = section_class(section.model_fields[part].annotation)
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
    if model.scratch is not None and model.dropout is not None:
        problems.append("model.dropout: a scratch model's dropout is model.scratch.dropout; set model.dropout to null")
    if model.scratch is not None and model.scratch.n_embd % model.scratch.n_head:
        problems.append(
            f"model.scratch.n_embd: {model.scratch.n_embd} is not divisible by n_head={model.scratch.n_head}; "
            "pick an n_embd that is a multiple of n_head"
        )
    if model.scratch is not None:
        allowed = task_kind(config.task).scratch_architectures
        if model.scratch.architecture not in allowed:
            problems.append(f"model.scratch.architecture: {model.scratch.architecture} does not do {config.task} QA; "
                            f"use one of {list(allowed)}")
    if data.train_file is None:
        problems.append("data.train_file: required; set it to your spreadsheet (.csv, .xlsx, .jsonl ...)")
    if task_kind(config.task).points and data.context_column is None:
        problems.append("data.context_column: required for task extractive; name the column holding the passages")
    if task_kind(config.task).writes:
        problems += _template_checks(data)
    problems += _answer_field_checks(config.task, data)
    problems += _choice_checks(config.task, data)
    if task_kind(config.task).scores:
        problems += _scoring_checks(config)
    else:
        if model.number_head != "regression":
            problems.append("model.number_head: only for task scoring (how its number heads predict); remove it")
        if data.class_weights != "none":
            problems.append("data.class_weights: only for task scoring (how its label heads weigh their classes); "
                            "remove it")
    if data.eval_file is not None and data.validation_fraction > 0:
        problems.append("data.validation_fraction: set it to 0 when data.eval_file is given (use one or the other)")
    return problems


def _template_checks(data: DataConfig) -> list[str]:
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


def _choice_checks(task: str, data: DataConfig) -> list[str]:
    """data.choice_columns: an exam sheet's choices, for the task whose record asks for them."""
    columns = data.choice_columns
    if task_kind(task).choice_columns == "refused":
        return [] if columns is None else [f"data.choice_columns: only for task multiple-choice (a question's "
                                           f"choices, one column each); remove it for task {task}"]
    if not columns or len(columns) < 2:
        return [f"data.choice_columns: task {task} needs at least two, one column per choice, e.g. [A, B, C, D]"]
    repeated = sorted({name for name in columns if columns.count(name) > 1})
    if repeated:
        return [f"data.choice_columns: {repeated} listed more than once; list each column once"]
    return []


def _answer_field_checks(task: str, data: DataConfig) -> list[str]:
    """data.answer_columns and the keys that go with it. The template itself is checked where it is built
    (qatune.data.grading_fields.AnswerTemplate, below which this layer sits), before any file is read."""
    columns = data.answer_columns
    if columns is None:
        problems = [f"data.{key}: only used with data.answer_columns; list the answer columns there, or remove it"
                    for key in ("answer_template", "field_kinds", "field_weights") if getattr(data, key) is not None]
        if task_kind(task).scores:
            problems.append("data.answer_columns: required for task scoring; list the label and number columns to "
                            "predict, e.g. [verdict, score]")
        return problems
    problems = []
    if task_kind(task).answer_columns == "refused":
        problems.append(f"data.answer_columns: not for task {task} (the answer is {task_kind(task).answer_said}); "
                        "set task: generative or scoring, or remove data.answer_columns and use data.answer_column")
    if not columns:
        problems.append("data.answer_columns: empty; list the answer columns, e.g. [score, label, feedback], or set "
                        "it to null for data.answer_column")
    repeated = sorted({name for name in columns if columns.count(name) > 1})
    if repeated:
        problems.append(f"data.answer_columns: {repeated} listed more than once; list each column once")
    for key in ("field_kinds", "field_weights"):
        for name in getattr(data, key) or {}:
            if name not in columns:
                close = difflib.get_close_matches(name, columns, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                problems.append(f"data.{key}: '{name}' is not one of data.answer_columns {columns}; {hint}"
                                f"give {key.split('_')[1]} only to answer columns")
    return problems


def _scoring_checks(config: Config) -> list[str]:
    """What a scoring model cannot do: write text, or train adapters."""
    problems = []
    text = [name for name, kind in (config.data.field_kinds or {}).items() if kind == "text"]
    if text:
        problems.append(f"data.field_kinds: {text} are text; a scoring model predicts label and number columns "
                        "only: train a generative run for free text (generate --file ... --with RUN puts both in "
                        "one sheet)")
    if config.model.lora is not None and not config.takes_lora:
        problems.append("model.lora: not for task scoring (a scoring model trains all its weights); remove it")
    return problems


def _problem_text(where: str, problems: list[str]) -> str:
    if len(problems) == 1:
        return f"{where}: {problems[0]}"
    lines = "\n".join(f"  - {problem}" for problem in problems)
    return f"{where} has {len(problems)} problems:\n{lines}"


def differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts."""
    keys = []
    for key in sorted(set(a) | set(b)):
        left, right = a.get(key), b.get(key)
        if isinstance(left, dict) and isinstance(right, dict):
            keys += differences(left, right, f"{prefix}{key}.")
        elif left != right:
            keys.append(prefix + key)
    return keys
