"""Every key the config accepts, with its type, default and documentation (``qatune config --keys``)."""

from __future__ import annotations

import json
import re
from typing import Any, Union

from pydantic import BaseModel

from qatune.config.sections import Config, section_class


def field_names() -> list[str]:
    """Every dotted key the config accepts (for documentation and suggestions)."""
    names: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            sub = section_class(field.annotation)
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
            sub = section_class(field.annotation)
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


def key_lines() -> list[str]:
    """``qatune config --keys``: each key with its type and default, its documentation on the next line."""
    rows = key_table()
    width = max(len(r["key"]) for r in rows)
    lines = []
    for r in rows:
        lines.append(f"{r['key']:<{width}}  {r['type']} = {r['default']}")
        lines += [f"{'':<{width}}    {r['doc']}"] if r["doc"] else []
    return lines


def _type_name(annotation: Any) -> str:
    args = getattr(annotation, "__args__", None)
    if getattr(annotation, "__origin__", None) is Union and args:
        return " | ".join(_type_name(a) for a in args)
    text = re.sub(r"qatune\.config\.(sections\.)?", "", str(annotation).replace("typing.", ""))
    for plain in ("int", "float", "str", "bool"):
        text = text.replace(f"<class '{plain}'>", plain)
    return text.replace("NoneType", "null")
