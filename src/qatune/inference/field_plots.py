"""Pictures of a grading run's answer fields: a confusion matrix per label field, predicted against gold per
number field. Drawn headless (matplotlib's Agg canvas, no pyplot), from a metrics' ``fields`` and the values.

eval writes them beside its results (confusion-NAME-FIELD.png, scores-NAME-FIELD.png), and the training
report draws them for the validation rows.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

from qatune.data.numbers import parse_number
from qatune.runs import atomic

log = logging.getLogger("qatune")

CONFUSION, SCORES = "confusion", "scores"
"""The two kinds of picture, and the first word of their file names."""


def picture_path(out_dir: Path, kind: str, stem: str, field: str) -> Path:
    """``OUT/KIND-STEM-FIELD.png``; characters of the field's name a file name should not have become _."""
    safe = re.sub(r"[^\w.-]+", "_", field).strip("_") or "field"
    return Path(out_dir) / f"{kind}-{stem}-{safe}.png"


def write_field_pictures(out_dir: Path, stem: str, fields: dict[str, dict[str, Any]], golds: dict[str, list[str]],
                         predicted: dict[str, list[str | None]]) -> dict[str, Path]:
    """Draw and write (atomically) the pictures of :func:`draw_field_pictures`; returns their paths by
    ``"KIND FIELD"`` (none when matplotlib is missing)."""
    paths = {}
    for kind, field, png in draw_field_pictures(fields, golds, predicted):
        path = picture_path(out_dir, kind, stem, field)
        atomic.atomic_write_bytes(path, png)
        paths[f"{kind} {field}"] = path
    return paths


def draw_field_pictures(fields: dict[str, dict[str, Any]], golds: dict[str, list[str]],
                        predicted: dict[str, list[str | None]]) -> list[tuple[str, str, bytes]]:
    """(kind, field, PNG bytes) for each label field (its metrics have a ``confusion``) and each number field
    (its metrics have a ``tolerance``), in the order of ``fields``; text fields have none.

    ``fields``: a metrics' ``fields`` (:func:`qatune.inference.field_metrics.grading_metrics`); ``golds`` and
    ``predicted``: per number field, its gold texts and predicted texts row by row (None: the answer did not
    parse)."""
    if importlib.util.find_spec("matplotlib") is None:
        log.warning("the answer fields' pictures are not drawn: matplotlib is not installed (pip install matplotlib)")
        return []
    pictures = []
    for name, metrics in fields.items():
        if "confusion" in metrics:
            confusion = metrics["confusion"]
            pictures.append((CONFUSION, name, confusion_png(name, confusion["labels"], confusion["matrix"])))
        elif "tolerance" in metrics and name in golds:
            pictures.append((SCORES, name, scores_png(name, golds[name], predicted[name], metrics["tolerance"],
                                                      metrics.get("decimal", "."))))
    return pictures


def confusion_png(field: str, labels: list[str], matrix: list[list[int]]) -> bytes:
    """A confusion matrix with its counts in the cells: gold labels on the rows (those with rows: labels that are
    only predicted have none), predicted ones on the columns."""
    rows = [i for i, counts in enumerate(matrix) if sum(counts)]
    counts = np.array([matrix[i] for i in rows], dtype=int).reshape(len(rows), len(labels))
    fig, axes = _figure(max(4.0, 1.0 + 0.9 * len(labels)), max(3.0, 1.5 + 0.6 * len(rows)))
    axes.imshow(counts, cmap="Blues", aspect="auto", vmin=0)
    brightest = counts.max() if counts.size else 0
    for (i, j), count in np.ndenumerate(counts):
        axes.text(j, i, str(count), ha="center", va="center",
                  color="white" if brightest and count > brightest / 2 else "black")
    axes.set_xticks(range(len(labels)), [_tick(label) for label in labels], rotation=30, ha="right")
    axes.set_yticks(range(len(rows)), [_tick(labels[i]) for i in rows])
    axes.set_xlabel("predicted")
    axes.set_ylabel("gold")
    axes.set_title(f"{field}: {int(counts.sum())} rows")
    return _png(fig)


def scores_png(field: str, golds: list[str], predicted: list[str | None], tolerance: float,
               decimal: str = ".") -> bytes:
    """Predicted against gold, one point per row whose gold and prediction are numbers, jittered (by up to a
    fifth of the smallest gap between gold values) so that equal pairs show as a cloud; the diagonal is a right
    answer, the dotted lines the tolerance around it. The title says how many rows had no number to plot."""
    pairs = [(g, p) for g, p in ((parse_number(g, decimal), None if p is None else parse_number(p, decimal))
                                 for g, p in zip(golds, predicted, strict=True)) if g is not None]
    points = np.array([(g, p) for g, p in pairs if p is not None], dtype=float).reshape(-1, 2)
    missing = len(pairs) - len(points)
    values = np.unique(np.array([g for g, _ in pairs], dtype=float))
    gap = float(np.min(np.diff(values))) if len(values) > 1 else 1.0
    jitter = np.random.default_rng(0).uniform(-0.2 * gap, 0.2 * gap, size=points.shape)
    fig, axes = _figure(5.0, 5.0)
    axes.scatter(points[:, 0] + jitter[:, 0], points[:, 1] + jitter[:, 1], s=14, alpha=0.5)
    everything = np.concatenate([values, points.ravel()]) if len(values) else np.array([0.0, 1.0])
    low, high = float(everything.min()) - gap / 2, float(everything.max()) + gap / 2
    axes.plot([low, high], [low, high], color="tab:gray", linewidth=1)
    if tolerance > 0:
        for side in (-tolerance, tolerance):
            axes.plot([low, high], [low + side, high + side], ":", color="tab:gray", linewidth=1)
    axes.set_xlim(low, high)
    axes.set_ylim(low, high)
    axes.set_xlabel("gold")
    axes.set_ylabel("predicted")
    note = f"; {missing} without a predicted number not shown" if missing else ""
    axes.set_title(f"{field}: {len(points)} rows{note}", fontsize=10)
    axes.grid(alpha=0.3)
    return _png(fig)


def _tick(label: str, limit: int = 24) -> str:
    """A label on one line, cut to ``limit`` characters (a predicted label can be any text the model wrote)."""
    label = " ".join(label.split())
    return label if len(label) <= limit else label[: limit - 1] + "…"


def _figure(width: float, height: float) -> tuple[Any, Any]:
    # A Figure on the Agg canvas renders to PNG without pyplot, its backends and its global figure list.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def _png(fig: Any) -> bytes:
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    return png.getvalue()
