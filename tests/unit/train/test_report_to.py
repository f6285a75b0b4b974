"""train.report_to mlflow and trackio: the numbers of metrics.jsonl and the config, in each tracker's local store."""

import contextlib
import json
import sys

import pytest
from click.testing import CliRunner

from qatune.cli import cli
from qatune.config import load_config
from qatune.errors import ConfigError
from qatune.train import logs
from qatune.train.logs import MetricsLog
from tests.conftest import tiny_config

ROWS = [(f"what is item {i}?", f"thing {i}") for i in range(20)]

TRACKER_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "MLFLOW_TAGS", "TRACKIO_DIR",
                     "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL")
"""What would send the trackers elsewhere than the run directory."""


@contextlib.contextmanager
def trackio_imported_anew():
    """trackio reads TRACKIO_DIR once, when first imported: inside, it is imported anew; after, what was is back."""
    def loaded():
        return [name for name in sys.modules if name == "trackio" or name.startswith("trackio.")]

    before = {name: sys.modules.pop(name) for name in loaded()}
    try:
        yield
    finally:
        for name in loaded():
            del sys.modules[name]
        sys.modules.update(before)


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """`qatune train` of a tiny model with validation, 10 training rows in batches of 4 for 2 epochs (3 steps an
    epoch), logging to TensorBoard, MLflow and trackio. Yields the run directory, its stdout and metrics.jsonl."""
    tmp = tmp_path_factory.mktemp("tracked")
    with pytest.MonkeyPatch.context() as patch, trackio_imported_anew():
        for name in TRACKER_VARIABLES:
            patch.delenv(name, raising=False)
        config = config_file(tmp, "train.epochs=2", "train.batch_size=4", "data.validation_fraction=0.5",
                             "train.report_to=[tensorboard, mlflow, trackio]")
        run_dir = tmp / "tracked-run"
        result = CliRunner().invoke(cli, ["train", "--quiet", "--config", config, "--output-dir", str(run_dir)])
        assert result.exit_code == 0, result.output
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        yield run_dir, result.stdout, lines


def config_file(tmp_path, *overrides):
    """A config of a tiny model on ROWS, written to tmp_path/config.yaml for `qatune train --config`."""
    path = tmp_path / "config.yaml"
    path.write_text(tiny_config(tmp_path, ROWS, *overrides).to_yaml())
    return str(path)


def jsonl(lines, event, key):
    return [(line["step"], line[key]) for line in lines if line["event"] == event]


def test_mlflow_holds_the_metrics_and_the_config(tracked):
    from mlflow import MlflowClient

    run_dir, _, lines = tracked
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tracked-run")
    (run,) = client.search_runs([experiment.experiment_id])
    assert (run.info.run_name, run.info.status) == ("tracked-run", "FINISHED")
    assert jsonl(lines, "train", "loss") == [(m.step, m.value) for m in client.get_metric_history(run.info.run_id,
                                                                                                 "train/loss")]
    assert len(jsonl(lines, "train", "loss")) == 6
    for key in ("loss", "f1", "exact_match"):
        assert jsonl(lines, "eval", key) == [(m.step, m.value) for m in client.get_metric_history(run.info.run_id,
                                                                                                  f"eval/{key}")]
    params = run.data.params
    assert params["model.scratch.n_embd"] == "32" and params["train.batch_size"] == "4"
    assert params["train.report_to"] == '["tensorboard", "mlflow", "trackio"]'
    assert not (run_dir / "mlflow" / "artifacts").exists()  # nothing logged there but the numbers


def test_trackio_holds_the_metrics_and_the_config(tracked):
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    run_dir, _, lines = tracked
    assert (run_dir / "trackio" / "tracked-run.db").is_file()
    (run,) = trackio.Api().runs("tracked-run")
    assert run.name == "tracked-run"
    assert run.config["model.scratch.n_embd"] == 32 and run.config["train.batch_size"] == 4
    logged = SQLiteStorage.get_logs("tracked-run", "tracked-run")
    assert jsonl(lines, "train", "loss") == [(row["step"], row["train/loss"]) for row in logged if "train/loss" in row]
    assert jsonl(lines, "eval", "f1") == [(row["step"], row["eval/f1"]) for row in logged if "eval/f1" in row]


def test_tensorboard_still_logs_beside_them_and_stdout_is_the_run_directory(tracked):
    run_dir, stdout, _ = tracked
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert stdout.strip() == str(run_dir)  # trackio's announcements went to stderr


def test_mlflow_tracking_uri_wins_and_a_resumed_run_is_named_so(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    for name in TRACKER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    elsewhere = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    config = tiny_config(tmp_path, ROWS, "train.report_to=mlflow")
    (tmp_path / "run").mkdir()
    metrics = MetricsLog(tmp_path / "run" / "metrics.jsonl", "mlflow", config,
                         resumed_from=tmp_path / "run" / "checkpoints" / "step-0000004")
    metrics.write({"event": "train", "step": 5, "epoch": 2, "loss": 1.5, "lr": 1e-3})
    metrics.close()
    assert not (tmp_path / "run" / "mlflow").exists()
    client = MlflowClient(elsewhere)
    (run,) = client.search_runs([client.get_experiment_by_name("run").experiment_id])
    assert run.info.run_name == "run (resumed from step-0000004)"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == [(5, 1.5)]


def test_only_the_main_process_logs(tmp_path, monkeypatch):
    """The loop hands metrics.jsonl's path to the main process only (two processes logging for one run: tested in
    tests/e2e/test_distributed.py); without it no tracker opens and nothing is written, with it every one does."""
    logged = []

    class Recording:
        name = "recording"

        def __init__(self, run_dir, run_name):
            self.kind = run_name

        def start(self):
            logged.append((self.kind, "start"))

        def store_init_configuration(self, params):
            pass

        def log(self, values, step):
            logged.append((self.kind, step))

        def finish(self):
            logged.append((self.kind, "finish"))

    monkeypatch.setattr(logs, "_OPEN", {"mlflow": Recording, "trackio": Recording})
    config = tiny_config(tmp_path, ROWS)
    (tmp_path / "run").mkdir()
    before = sorted(tmp_path.rglob("*"))
    for path in (None, tmp_path / "run" / "metrics.jsonl"):  # another process, then the main one
        metrics = MetricsLog(path, ["tensorboard", "mlflow", "trackio"], config)
        metrics.write({"event": "train", "step": 1, "loss": 1.0})
        metrics.close()
        if path is None:
            assert logged == [] and sorted(tmp_path.rglob("*")) == before
    assert logged == [("run", "start"), ("run", "start"), ("run", 1), ("run", 1), ("run", "finish"), ("run", "finish")]
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize(("value", "kept"), [("none", "none"), ("tensorboard", "tensorboard"), ("trackio", "trackio"),
                                             ("[tensorboard, mlflow]", ["tensorboard", "mlflow"]), ("[]", [])])
def test_report_to_takes_a_name_or_a_list(tmp_path, value, kept):
    config = tiny_config(tmp_path, ROWS, f"train.report_to={value}")
    assert config.train.report_to == kept  # as written: configs with report_to: none|tensorboard load unchanged


@pytest.mark.parametrize(("value", "message"), [
    ("mlfow", "train.report_to: unknown tracker 'mlfow'; did you mean 'mlflow'? report_to takes none, tensorboard, "
              "mlflow, trackio or a list of them"),
    ("[tensorboard, trakio]", "unknown tracker 'trakio'; did you mean 'trackio'?"),
    ("[none]", "unknown tracker 'none'; report_to takes"),
])
def test_an_unknown_tracker_is_named_with_the_ones_there_are(value, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, ["data.train_file=qa.csv", f"train.report_to={value}"])
    assert message in str(error.value)


def test_a_missing_package_stops_train_in_one_line_before_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(logs, "installed", lambda module: module not in ("trackio", "sqlalchemy"))
    config = config_file(tmp_path, "train.report_to=[mlflow, tensorboard, trackio]")
    result = CliRunner().invoke(cli, ["train", "--config", config, "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 1
    assert result.output == "error: train.report_to mlflow and trackio need: pip install 'qatune[mlflow,trackio]'\n"
    assert not (tmp_path / "run").exists()


def test_a_tracker_that_cannot_start_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuch://tracking")
    with pytest.raises(ConfigError, match=r"^train\.report_to mlflow: cannot start logging: .*nosuch"):
        MetricsLog(tmp_path / "metrics.jsonl", "mlflow")


def test_a_run_that_fails_ends_failed_in_mlflow(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from qatune.errors import TrainingError
    from qatune.train import fit, prepare
    from tests.unit.train.test_nan_guard import poison_forward

    for name in TRACKER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    prepared = prepare(tiny_config(tmp_path, ROWS, "train.report_to=mlflow", "train.max_nonfinite_steps=1"))
    poison_forward(prepared.model, at_calls={2})
    run_dir = tmp_path / "failing"
    run_dir.mkdir()
    with pytest.raises(TrainingError, match="non-finite"):
        fit(prepared, run_dir, progress=False)
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("failing").experiment_id])
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1]  # the step before
