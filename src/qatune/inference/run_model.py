"""A run's model loaded for evaluation and generation: a run directory, one of its model folders, or a .gguf file
(one that ``qatune export --gguf`` wrote, or any other a llama.cpp user has)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from qatune.config import Config
from qatune.model.folder import LoadedModel, ModelInfo, load_model_folder, read_model_folder
from qatune.model.gguf_file import gguf_path, load_gguf_run, read_gguf_run
from qatune.runs import atomic, layout
from qatune.speedups import for_inference


def read_run(path: str | Path, which: str = layout.FINAL) -> tuple[Config, ModelInfo]:
    """What a run's prompt needs, read before its model loads (a .gguf file: from its metadata)."""
    file = gguf_path(path)
    if file is not None:
        return read_gguf_run(file)
    return read_model_folder(layout.find_model_folder(path, which))


def load_run_model(path: str | Path, which: str = layout.FINAL, device: str | None = None) -> LoadedModel:
    """A run's model folder (:func:`qatune.model.folder.load_model_folder`) or a .gguf file
    (:func:`qatune.model.gguf_file.load_gguf_run`), with the speed paths the run's ``train.speedups`` allows at
    inference."""
    file = gguf_path(path)
    loaded = load_gguf_run(file, device) if file is not None else load_model_folder(path, which, device)
    for_inference(loaded.model, loaded.config.train.speedups)
    return loaded


def results_place(path: str | Path, loaded: LoadedModel) -> tuple[Path, str]:
    """Where eval and generate write their files, and what their names start with after eval-/answers-: the run
    directory (RUN/final itself given: the run's), or a .gguf file's folder with the file's name first, so that
    the results of two files in one folder do not meet."""
    if loaded.folder.is_file():
        return loaded.folder.parent, f"{loaded.folder.stem}-"
    return layout.results_dir(Path(path), loaded.folder), ""


def model_id(loaded: LoadedModel) -> str | None:
    """Which writing of the model was evaluated: a folder's manifest digest, a file's size and time."""
    if loaded.folder.is_file():
        stat = loaded.folder.stat()
        return hashlib.sha256(f"{loaded.folder.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return atomic.folder_id(loaded.folder)
