"""``qatune eval``: which model is evaluated on which rows (a run, the base model of a config, or a run beside
another for ``--compare``), and the lines it prints."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qatune.errors import QatuneError
from qatune.inference.metric_records import ANSWER, metrics_of


@dataclass
class EvalResult:
    metrics: dict[str, Any]
    paths: dict[str, Path]
    compared: dict[str, Any] | None = None
    """--compare's summary (its "files" are compare-FILE.md and .csv)."""

    def as_json(self) -> dict[str, Any]:
        return self.metrics if self.compared is None else {**self.metrics, "compare": self.compared}


def run_eval(run_dir: str | None, data_file: str | None, which: str, base: bool, config_path: str | None,
             overrides: tuple[str, ...], batch_size: int | None, compare_with: str | None,
             progress: bool, grounded: str | None = None) -> EvalResult:
    """The options of ``qatune eval`` checked against each other, then the evaluation they ask for. ``grounded``:
    --grounded (generate.grounded for this evaluation; None: the run's own)."""
    from qatune.evaluation.evaluate import evaluate_base, evaluate_run

    if base:
        if compare_with is not None:
            raise QatuneError("--compare goes with a RUN_DIR: qatune eval RUN --data FILE --compare base")
        if run_dir is not None or config_path is None:
            raise QatuneError("--base evaluates the model a config starts from: pass --config X.yaml and no RUN_DIR")
        from qatune.config import load_config

        config = load_config(config_path, overrides)
        if grounded is not None:
            config = config.model_copy(update={"generate": config.generate.model_copy(update={"grounded": grounded})})
        return EvalResult(*evaluate_base(config, data_file, batch_size, progress))
    if run_dir is None:
        raise QatuneError("pass the RUN_DIR to evaluate (or --base --config X.yaml for the model before training)")
    if config_path is not None:
        raise QatuneError("--config goes with --base; a run is evaluated with its own saved config")
    if data_file is None:
        raise QatuneError("pass the held-out file with --data FILE")
    if compare_with is None:
        return EvalResult(*evaluate_run(run_dir, data_file, which, batch_size, progress, reading=overrides,
                                        grounded=grounded))
    from qatune.evaluation.compare_report import compare_run

    run, compared = compare_run(run_dir, data_file, compare_with, which, batch_size, progress=progress,
                                reading=overrides, grounded=grounded)
    return EvalResult(run.metrics, run.paths, compared)


def result_lines(result: EvalResult) -> list[str]:
    """What ``qatune eval`` prints without --json: the metrics, each field's, and the files written."""
    from qatune.evaluation.compare_report import summary_lines
    from qatune.evaluation.evaluate import field_summary

    metrics, paths = result.metrics, result.paths
    lines = []
    for key in metrics_of(ANSWER):
        value = metrics.get(key)
        lines.append(f"{key:<12} {value:.4f}" if isinstance(value, float) else f"{key:<12} n/a")
    lines.append(f"{'num_examples':<12} {metrics['num_examples']}")
    if "grounded" in metrics:
        lines.append(f"{'grounded':<12} {'on' if metrics['grounded'] else 'off'}; answers in their passage: "
                     f"{metrics['in_passage'] or 0:.1f}%")
    lines += field_summary(metrics)
    lines.append(f"predictions  {paths['predictions']}")
    lines += [f"picture      {path}" for key, path in paths.items() if key not in ("metrics", "predictions")]
    if result.compared is not None:
        lines += summary_lines(result.compared)
        lines += [f"comparison   {result.compared['files'][kind]}" for kind in ("markdown", "csv")]
    return lines
