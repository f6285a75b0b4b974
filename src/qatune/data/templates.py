"""Prompt templates: the text a generative model reads before the answer, for any spreadsheet's columns.

A prompt template is a text with ``{placeholders}``: ``{question}``, ``{context}`` and any other column of
the spreadsheet (``{Total Marks}``). A chat model's template is rendered once around those placeholders
(:func:`chat_template`), so the template a run saves is the exact text the model reads; such a template
writes the special tokens itself, and its answers end with the chat template's end-of-turn token
(:func:`end_of_turn_id`). A base model whose tokenizer has no chat template but has its family's turn markers
(Gemma's ``<start_of_turn>``) is given its family's template (:data:`BASE_CHAT_TEMPLATES`), written into the
tokenizer so that the run's ``final/`` carries it.
"""

from __future__ import annotations

import logging
import re
import string
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qatune.config.columns import PLACEHOLDER, column_key, template_fields
from qatune.errors import ConfigError, DataError

if TYPE_CHECKING:
    from qatune.config import DataConfig

log = logging.getLogger("qatune")

DEFAULT_TEMPLATE = "Question: {question}\nAnswer:"
DEFAULT_CONTEXT_TEMPLATE = "Context: {context}\nQuestion: {question}\nAnswer:"
DEFAULT_USER_MESSAGE = "{question}"
DEFAULT_CONTEXT_USER_MESSAGE = "{context}\n\nQuestion: {question}"
ROLES = ("question", "context")
"""Placeholders that stand for data.question_column and data.context_column; any other name is a column."""

GEMMA_TURNS = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\\n\\n' if messages[0]['content'] else '' %}"
    "{% set messages = messages[1:] %}{% else %}{% set first = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
"""Gemma 3 instruct's chat template for text: the BOS, a system message as the start of the first user turn (an
empty one adds nothing), the assistant's turn as the model's, each turn ended by ``<end_of_turn>``."""
BASE_CHAT_TEMPLATES = {("<start_of_turn>", "<end_of_turn>"): GEMMA_TURNS}
"""The chat template of a base model whose tokenizer has none, by the turn markers its vocabulary holds as special
tokens: Gemma's base models (Gemma 3 270M's GGUF file, Gemma 2's) have their instruct models' markers, and are
fine-tuned to answer in those turns."""

# Private-use characters no spreadsheet cell or chat template is likely to hold.
_USER_MARK, _ANSWER_MARK = "\ue000qatune-user\ue001", "\ue000qatune-answer\ue001"


@dataclass(frozen=True)
class PromptTemplate:
    """The text before the answer. The answer follows after ``answer_prefix`` and ends with an end token."""

    template: str = DEFAULT_TEMPLATE
    answer_prefix: str = " "

    def render(self, question: str, context: str | None = None, fields: dict[str, str] | None = None) -> str:
        values = {**(fields or {}), "question": question, "context": context or ""}

        def fill(match: re.Match) -> str:
            text = match.group(0)
            if text in ("{{", "}}"):
                return text[0]
            name = match.group(1)
            if name is None:
                raise DataError(f"prompt template {self.template!r} has unbalanced braces")
            if name not in values:
                raise DataError(f"the prompt needs the column {name!r} besides the question; answer a file that "
                                f"has it (qatune generate RUN --file FILE) or pass it (--field '{name}=VALUE')")
            return values[name]

        return PLACEHOLDER.sub(fill, self.template)

    @property
    def fields(self) -> list[str]:
        """Column names the template reads besides the question and the context."""
        return [name for name in template_fields(self.template) or [] if name not in ROLES]

    def match_fields(self, given: dict[str, str]) -> tuple[dict[str, str], list[str], list[str]]:
        """Values given for the template's columns, matched by name ignoring case, spaces, _ and -.

        Returns the values by the names the template uses, the given names it does not use, and the
        names it uses that were not given (or given blank: in training a blank cell drops its row).
        """
        by_key = {column_key(name): name for name in self.fields}
        values: dict[str, str] = {}
        unknown: list[str] = []
        for name, value in given.items():
            if column_key(name) not in by_key:
                unknown.append(name)
            elif value.strip():
                values[by_key[column_key(name)]] = value
        missing = [name for name in self.fields if name not in values]
        return values, unknown, missing

    @property
    def uses_context(self) -> bool:
        return "context" in (template_fields(self.template) or [])


DEFAULT_SCORING_TEMPLATE = "{question}"
DEFAULT_CONTEXT_SCORING_TEMPLATE = "{context}\n\n{question}"


def scoring_template(data: DataConfig) -> PromptTemplate:
    """The text a scoring model reads of a row: data.prompt_template with the row's columns filled in (no chat
    template: the model reads the text, it does not answer it); auto or chat: the question (after the context)."""
    if data.prompt_template in ("auto", "chat"):
        return PromptTemplate(DEFAULT_CONTEXT_SCORING_TEMPLATE if data.context_column else DEFAULT_SCORING_TEMPLATE,
                              answer_prefix="")
    columns = {"question": data.question_column, "context": data.context_column}
    return PromptTemplate(_canonical(data.prompt_template, columns), answer_prefix="")


def resolve_template(data: DataConfig, tokenizer: Any = None, model_name: str = "the model") -> PromptTemplate:
    """The template a run trains with, from the config's data section (and the tokenizer's chat template).

    ``auto`` is the chat template when the tokenizer has one (or is given its family's here, in the tokenizer
    itself: :func:`give_base_chat_template`), else the plain question/answer template. Placeholders that name the
    question or context column are written as {question}/{context}, so truncation cuts them like the roles they
    are.
    """
    setting = data.prompt_template
    if setting in ("auto", "chat") and tokenizer is not None:
        give_base_chat_template(tokenizer, model_name)
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if setting == "chat" and tokenizer is not None and not has_chat:
        raise ConfigError(f"data.prompt_template: chat, but the tokenizer of {model_name} has no chat template; "
                          "use auto or write the template, e.g. \"Question: {question}\\nAnswer:\"")
    columns = {"question": data.question_column, "context": data.context_column}
    if setting == "chat" and tokenizer is None:
        setting = "auto"  # a scratch tokenizer is trained before the template is needed; it has no chat template
    if setting == "chat" or (setting == "auto" and has_chat):
        user = data.user_template or _with_choices(DEFAULT_CONTEXT_USER_MESSAGE if data.context_column
                                                   else DEFAULT_USER_MESSAGE, data)
        return chat_template(tokenizer, _canonical(user, columns), data.system_prompt, model_name)
    if setting == "auto":
        if tokenizer is not None and (data.user_template is not None or data.system_prompt is not None):
            log.warning("data.user_template and data.system_prompt are not used: the tokenizer of %s has no chat "
                        "template, so data.prompt_template auto is the plain question/answer template", model_name)
        return PromptTemplate(_with_choices(DEFAULT_CONTEXT_TEMPLATE if data.context_column else DEFAULT_TEMPLATE,
                                            data))
    return PromptTemplate(_canonical(setting, columns))


def _with_choices(template: str, data: DataConfig) -> str:
    """A default template with data.choice_columns listed after the question, one line each ("B. {Second}")."""
    if not data.choice_columns:
        return template
    lines = "".join(f"\n{letter}. {{{name}}}" for letter, name in zip(string.ascii_uppercase, data.choice_columns))
    return template.replace("{question}", "{question}" + lines, 1)


def base_chat_template(tokenizer: Any) -> str | None:
    """The chat template :data:`BASE_CHAT_TEMPLATES` holds for a tokenizer with none (None: it has one, or its
    special tokens are no family's turn markers)."""
    if getattr(tokenizer, "chat_template", None):
        return None
    special = special_tokens(tokenizer)
    return next((template for markers, template in BASE_CHAT_TEMPLATES.items()
                 if all(marker in special for marker in markers)), None)


def give_base_chat_template(tokenizer: Any, model_name: str = "the model") -> bool:
    """Write its family's chat template into a tokenizer that has none (:func:`base_chat_template`): the run
    trains in those turns, its end-of-turn token ends every answer, and the tokenizer the run saves asks the model
    as training did. Whether one was written."""
    template = base_chat_template(tokenizer)
    if template is None:
        return False
    tokenizer.chat_template = template
    log.info("the tokenizer of %s has no chat template; it is given its family's turns (%s), and the run saves it",
             model_name, " ... ".join(next(m for m, t in BASE_CHAT_TEMPLATES.items() if t == template)))
    return True


def chat_template(tokenizer: Any, user_template: str, system_prompt: str | None = None,
                  model_name: str = "the model") -> PromptTemplate:
    """The tokenizer's chat template rendered once: a system message (``None``: the template's own
    default), a user message made of ``user_template`` and the opening of the assistant's turn.

    The result is a plain template whose text holds the chat markup (special tokens included) with
    the user message's placeholders inside; ``answer_prefix`` is what the chat template puts between
    the opening of the assistant's turn and its content when that is blanks (usually nothing); markup the template
    writes before every answer (an empty thinking block) ends the prompt instead, as the template's own generation
    prompt for answers without thinking does.
    """
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    messages.append({"role": "user", "content": _USER_MARK})
    try:
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": _ANSWER_MARK}],
                                             tokenize=False)
    except Exception as exc:  # jinja raises its own kinds (a template refusing a system message, ...)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = "; leave data.system_prompt unset" if system_prompt is not None else ""
        raise ConfigError(f"the chat template of {model_name} cannot render a prompt ({reason}){hint}; or set "
                          "data.prompt_template to a template of your own") from None
    if prompt.count(_USER_MARK) != 1 or not full.startswith(prompt) or _ANSWER_MARK not in full[len(prompt):]:
        raise ConfigError(f"the chat template of {model_name} does not keep the user's message and the answer apart "
                          "as qatune needs; set data.prompt_template to a template of your own")
    before, after = prompt.split(_USER_MARK)
    prefix = full[len(prompt): full.index(_ANSWER_MARK, len(prompt))]
    if prefix.strip():  # markup before every answer (Qwen3's empty thinking block): the prompt's, never trained
        after, prefix = after + prefix, ""
    text = _escape(before) + user_template + _escape(after)
    return PromptTemplate(text, answer_prefix=prefix)


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token a chat template puts right after an assistant's answer (None: no chat template)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _ANSWER_MARK}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template that cannot render this: answers end with the EOS
        return None
    if _ANSWER_MARK not in text:
        return None
    after = text[text.index(_ANSWER_MARK) + len(_ANSWER_MARK):]
    special = set(special_tokens(tokenizer).values())
    for token in tokenizer(after, add_special_tokens=False)["input_ids"]:
        if token in special:
            return token
    return None


def special_tokens(tokenizer: Any) -> dict[str, int]:
    """The tokenizer's special tokens, text -> id: the named ones (BOS, EOS, ...) and every added token
    marked special (a chat template's <|im_start|>, <end_of_turn>, ...)."""
    found = {}
    for token in getattr(tokenizer, "all_special_tokens", None) or []:
        found[token] = tokenizer.convert_tokens_to_ids(token)
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            found[str(token)] = token_id
    return {text: token_id for text, token_id in found.items() if text}


def _canonical(template: str, columns: dict[str, str | None]) -> str:
    """Write a placeholder naming the question or context column as {question} / {context}."""
    keys = {role: role for role in ROLES} | {column_key(name): role for role, name in columns.items() if name}

    def rename(match: re.Match) -> str:
        name = match.group(1)
        if name is None or column_key(name) not in keys:
            return match.group(0)
        return "{" + keys[column_key(name)] + "}"

    return PLACEHOLDER.sub(rename, template)


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")
