"""``train(config)``: check the output folder, prepare, create the run directory, then fit with the outcome
recorded (:mod:`qatune.train.outcome`); or ``--resume`` (:mod:`qatune.train.resume`)."""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

from qatune import __version__
from qatune.config import Config
from qatune.errors import RunDirError
from qatune.model.folder import ModelInfo, save_model
from qatune.runs import layout
from qatune.runs.lock import RunLock
from qatune.train import sharding
from qatune.train.device import is_main_process
from qatune.train.outcome import prepare_checked, run_and_record
from qatune.train.preparation import fingerprint
from qatune.train.resume import resume_run


def train(config: Config, output_dir: str | Path | None = None, overwrite: bool = False,
          progress: bool = True, resume: str | Path | None = None) -> Path:
    """Fine-tune according to ``config`` and return the run directory (with final/ inside).

    ``resume``: a run directory or checkpoint to continue from ("" for the config's output_dir).
    """
    sharding.check_setup(config)
    run_dir = Path(output_dir or config.output_dir)
    if output_dir is not None:
        config = config.model_copy(update={"output_dir": str(output_dir)})
    if resume is not None:
        if overwrite:
            raise RunDirError("--resume and --overwrite contradict each other; pass one of them")
        return resume_run(config, Path(resume) if str(resume) else run_dir, progress)
    main = is_main_process()
    if main:
        layout.check_output_path(run_dir)
    # Under accelerate launch, only the main process locks and writes files.
    with RunLock(run_dir) if main else nullcontext():
        if main:
            layout.check_output_dir(run_dir, overwrite)
        prepared = prepare_checked(config)
        if main:
            layout.create_run_dir(run_dir, overwrite)
            layout.write_config(run_dir, config.to_yaml())
            if prepared.base_model is not None:
                save_model(run_dir / layout.BASE, prepared.base_model, prepared.tokenizer, config,
                           ModelInfo(task=config.task, max_length=prepared.info.max_length))
                prepared.base_model = None  # a full copy of the model: training does not need it in memory
            layout.write_status(run_dir, status="running", qatune_version=__version__,
                                started=time.strftime("%Y-%m-%d %H:%M:%S"), task=config.task,
                                precision=prepared.precision,
                                max_length=prepared.info.max_length, data=prepared.reports,
                                data_fingerprint=fingerprint(prepared))
        return run_and_record(prepared, run_dir, progress)
