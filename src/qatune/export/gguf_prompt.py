"""The run's prompt outside qatune: a Jinja chat template for the GGUF file that renders it exactly, and an Ollama
Modelfile whose TEMPLATE does the same."""

from __future__ import annotations

import json

from qatune.config.columns import PLACEHOLDER, column_key
from qatune.data.generative import PromptEncoder
from qatune.data.templates import PromptTemplate
from qatune.model.folder import LoadedModel


def _segments(template: str) -> list[tuple[str, str]]:
    """A qatune prompt template as ("text", literal) and ("field", question|context) pieces."""
    pieces: list[tuple[str, str]] = []
    last = 0
    for match in PLACEHOLDER.finditer(template):
        if match.start() > last:
            pieces.append(("text", template[last:match.start()]))
        token = match.group(0)
        if token in ("{{", "}}"):
            pieces.append(("text", token[0]))
        else:
            pieces.append(("field", column_key(match.group(1))))
        last = match.end()
    if last < len(template):
        pieces.append(("text", template[last:]))
    return pieces


def chat_template(prompt_template: str, answer_prefix: str = "", end: str = "") -> str:
    """A Jinja chat template that renders exactly the run's prompt: its question is the last user message, its
    context the last system message; an assistant message after that user message is rendered as the run's
    training text goes on (``answer_prefix``, the answer, ``end``: the text of the token that ends an answer)."""
    out = ["{%- set ns = namespace(question='', context='', answer=none) -%}",
           "{%- for message in messages -%}",
           "{%- if message['role'] == 'user' -%}{%- set ns.question = message['content'] -%}"
           "{%- set ns.answer = none -%}",
           "{%- elif message['role'] == 'system' -%}{%- set ns.context = message['content'] -%}",
           "{%- elif message['role'] == 'assistant' -%}{%- set ns.answer = message['content'] -%}{%- endif -%}",
           "{%- endfor -%}"]
    for kind, value in _segments(prompt_template):
        out.append("{{ ns." + value + " }}" if kind == "field" else "{{ " + _jinja_string(value) + " }}")
    out.append("{%- if ns.answer is not none -%}{{ " + _jinja_string(answer_prefix) + " }}{{ ns.answer }}{{ "
               + _jinja_string(end) + " }}{%- endif -%}")
    return "".join(out)


def _jinja_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def modelfile(loaded: LoadedModel, file_name: str) -> str:
    """An Ollama Modelfile that asks the file exactly as qatune asked the run."""
    info, generate = loaded.info, loaded.config.generate
    template = "".join(
        ("{{ .Prompt }}" if value == "question" else "{{ .System }}") if kind == "field"
        else value.replace("{{", '{{ "{{" }}') for kind, value in _segments(info.prompt_template))
    encoder = PromptEncoder(loaded.tokenizer, PromptTemplate(info.prompt_template, info.answer_prefix))
    stops = [loaded.tokenizer.decode([index]) for index in encoder.stop_ids]
    lines = [f"FROM ./{file_name}", f'TEMPLATE """{template}"""']
    lines += [f'PARAMETER stop "{stop}"' for stop in stops if stop and '"' not in stop]
    lines += [f"PARAMETER temperature {generate.temperature:g}", f"PARAMETER num_predict {generate.max_new_tokens}"]
    if generate.temperature > 0:
        lines.append(f"PARAMETER top_p {generate.top_p:g}")
    return "\n".join(lines) + "\n"


def modelfile_prompt(text: str, question: str, context: str = "") -> str:
    """What Ollama renders from a Modelfile's TEMPLATE for one question (its only actions are these two)."""
    template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    return (template.replace('{{ "{{" }}', "\0").replace("{{ .Prompt }}", question)
            .replace("{{ .System }}", context).replace("\0", "{{"))
