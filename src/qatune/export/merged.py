"""``qatune export RUN --merge OUT``: a run's model as a plain transformers folder, LoRA adapters folded in."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from qatune.errors import RunDirError
from qatune.model.folder import ModelInfo, load_model_folder, save_model
from qatune.runs import layout
from qatune.runs.lock import RunLock


def export_merged(run_dir: str | Path, output: str | Path, which: str = layout.FINAL) -> Path:
    """A run's model as a plain transformers folder, LoRA adapters merged in."""
    output = Path(output)
    with RunLock(output, "export folder"):
        if output.exists() and (not output.is_dir() or any(output.iterdir())):
            raise RunDirError(f"{output} already exists and is not an empty folder; choose another output folder")
        loaded = load_model_folder(run_dir, which, device="cpu")
        config = loaded.config.model_copy(deep=True)
        config.model.lora = None
        info = ModelInfo(**{**asdict(loaded.info), "lora_base": None})
        output.parent.mkdir(parents=True, exist_ok=True)
        save_model(output, loaded.model, loaded.tokenizer, config, info)
    return output
