"""A run's model loaded for evaluation and generation."""

from __future__ import annotations

from pathlib import Path

from qatune.model.folder import LoadedModel, load_model_folder
from qatune.runs import layout
from qatune.speedups import for_inference


def load_run_model(path: str | Path, which: str = layout.FINAL, device: str | None = None) -> LoadedModel:
    """A run's model folder (:func:`qatune.model.folder.load_model_folder`), with the speed paths the run's
    ``train.speedups`` allows at inference."""
    loaded = load_model_folder(path, which, device)
    for_inference(loaded.model, loaded.config.train.speedups)
    return loaded
