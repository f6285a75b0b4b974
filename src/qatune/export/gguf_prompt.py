"""The run's prompt outside qatune: a Jinja chat template for the GGUF file that renders it exactly, and an Ollama
Modelfile whose TEMPLATE does the same.

Both read a conversation alike: the question is the last user message; the passage (a prompt's ``{context}``) is
the system messages, joined by a blank line as Ollama joins them; a run whose prompt has no ``{context}`` reads no
system message, so a chat client's own system prompt changes nothing there."""

from __future__ import annotations

import unicodedata

from qatune.config.columns import PLACEHOLDER, column_key
from qatune.data.generative import PromptEncoder
from qatune.data.templates import PromptTemplate
from qatune.export import ExportError
from qatune.model.folder import LoadedModel

JINJA_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
"""What a Jinja string literal needs escaped, each written with an escape that jinja2, llama.cpp's template engine
and @huggingface/jinja all read (none reads ``\\uXXXX`` but jinja2 and @huggingface/jinja). Line breaks are
escaped, not written as they are: engines strip or normalise raw line breaks around tags and carriage returns."""

PASSAGE_JOIN = "\n\n"
"""Between two system messages in the passage: what Ollama joins them with before its TEMPLATE sees them."""


def _segments(template: str) -> list[tuple[str, str]]:
    """A qatune prompt template as ("text", literal) and ("field", question|context) pieces, adjacent literals
    joined."""
    pieces: list[tuple[str, str]] = []

    def text(value: str) -> None:
        if pieces and pieces[-1][0] == "text":
            pieces[-1] = ("text", pieces[-1][1] + value)
        elif value:
            pieces.append(("text", value))

    last = 0
    for match in PLACEHOLDER.finditer(template):
        text(template[last:match.start()])
        token = match.group(0)
        if token in ("{{", "}}"):
            text(token[0])
        else:
            pieces.append(("field", column_key(match.group(1))))
        last = match.end()
    text(template[last:])
    return pieces


def unwritable_characters(text: str) -> list[str]:
    """The control characters of ``text`` a chat template cannot carry to every engine (all but tab and line
    breaks), each as ``U+001B``."""
    found = sorted({c for c in text if unicodedata.category(c) == "Cc" and c not in JINJA_ESCAPES})
    return [f"U+{ord(c):04X}" for c in found]


def chat_template(prompt_template: str, answer_prefix: str = "", end: str = "") -> str:
    """A Jinja chat template that renders exactly the run's prompt: its question is the last user message, its
    context the system messages (see the module's docstring); an assistant message after that user message is
    rendered as the run's training text goes on (``answer_prefix``, the answer, ``end``: the text of the token
    that ends an answer). One line, so that no engine's handling of line breaks around tags can change it."""
    out = ["{%- set ns = namespace(question='', context='', answer=none, passage=false) -%}",
           "{%- for message in messages -%}",
           "{%- if message['role'] == 'user' -%}{%- set ns.question = message['content'] -%}"
           "{%- set ns.answer = none -%}",
           # Read even where the prompt has no {context}: llama.cpp merges a system message into the user's
           # message when its template never reads one.
           "{%- elif message['role'] == 'system' or message['role'] == 'developer' -%}"
           "{%- set ns.context = ns.context ~ (" + jinja_string(PASSAGE_JOIN) + " if ns.passage else '') ~ "
           "message['content'] -%}{%- set ns.passage = true -%}",
           "{%- elif message['role'] == 'assistant' -%}{%- set ns.answer = message['content'] -%}{%- endif -%}",
           "{%- endfor -%}"]
    for kind, value in _segments(prompt_template):
        out.append("{{ ns." + value + " }}" if kind == "field" else "{{ " + jinja_string(value) + " }}")
    out.append("{%- if ns.answer is not none -%}{{ " + jinja_string(answer_prefix) + " }}{{ ns.answer }}{{ "
               + jinja_string(end) + " }}{%- endif -%}")
    return "".join(out)


def jinja_string(text: str) -> str:
    """``text`` as a double-quoted Jinja string literal that every engine reads back as ``text``."""
    unwritable = unwritable_characters(text)
    if unwritable:
        raise ExportError(f"the run's prompt holds the control character(s) {', '.join(unwritable)}, which a chat "
                          "template cannot carry to llama.cpp and other engines (only tabs and line breaks can be "
                          f"written): {text[:80]!r}")
    return '"' + "".join(JINJA_ESCAPES.get(c, c) for c in text) + '"'


def _go_text(text: str) -> str:
    """Literal text of a Go template inside a Modelfile's triple quotes. Written as Go string actions: an opening
    brace (two would open an action), the closing quotes, and what Ollama's Modelfile parser drops (a character
    that is not printable, but for line breaks and tabs)."""

    def action(c: str) -> str:
        return '{{ "' + (c if c == "{" else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}") + '" }}'

    written = "".join(c if c in "\n\t" or (c.isprintable() and c != "{") else action(c) for c in text)
    return written.replace('"""', '{{ "\\"\\"\\"" }}')


def modelfile(loaded: LoadedModel, file_name: str) -> str:
    """An Ollama Modelfile that asks the file exactly as qatune asked the run. Its TEMPLATE ranges over
    ``.Messages`` (Ollama then renders it once for the whole conversation): the question is the last user
    message, the passage ``.System`` (Ollama's join of every system message)."""
    info, generate = loaded.info, loaded.config.generate
    question = ('{{ $question := "" }}{{ range .Messages }}{{ if eq .Role "user" }}{{ $question = .Content }}'
                '{{ end }}{{ end }}')
    body = "".join(("{{ $question }}" if value == "question" else "{{ .System }}") if kind == "field"
                   else _go_text(value) for kind, value in _segments(info.prompt_template))
    encoder = PromptEncoder(loaded.tokenizer, PromptTemplate(info.prompt_template, info.answer_prefix))
    stops = [loaded.tokenizer.decode([index]) for index in encoder.stop_ids]
    lines = [f"FROM ./{file_name}", f'TEMPLATE """{question}{body}"""']
    lines += [f'PARAMETER stop "{stop}"' for stop in stops if stop and '"' not in stop]
    lines += [f"PARAMETER temperature {generate.temperature:g}", f"PARAMETER num_predict {generate.max_new_tokens}"]
    if generate.temperature > 0:
        lines.append(f"PARAMETER top_p {generate.top_p:g}")
    return "\n".join(lines) + "\n"
