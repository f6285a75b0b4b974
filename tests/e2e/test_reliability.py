"""What real machines add: two runs on one directory, a full disk, a damaged run directory, interrupts
during validation and during the report."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from qatune.cli import cli
from qatune.runs import atomic
from qatune.runs import lock as lock_module
from qatune.runs.lock import RunLock
from qatune.train import TrainingInterrupted, train
from qatune.train import outcome as run_module
from qatune.train import validation as validation_module
from qatune.train.checkpoint import find_checkpoint, list_checkpoints
from tests.conftest import interrupt_at, tiny_config

pytestmark = pytest.mark.slow

ROWS = [(f"question number {i}", f"answer {i % 5}") for i in range(12)]


def config_for(tmp_path, *overrides):
    # 12 rows, batch 4: 3 steps per epoch; a checkpoint after every step
    return tiny_config(tmp_path, ROWS, "train.epochs=3", "train.batch_size=4", "train.save_every=1",
                       "train.keep_checkpoints=5", "train.learning_rate=3e-3", *overrides)


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line_error(result, *fragments):
    assert result.exit_code == 1, result.output + result.stderr
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and lines[-1].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]
    return lines[-1]


# --- two processes, one run directory ---------------------------------------------------------------

HOLD_LOCK = """
import sys, time
from qatune.runs.lock import RunLock
run, sys.argv = sys.argv[1], ["qatune", *sys.argv[2:]]   # the command the lock records
RunLock(run).acquire()
print("locked", flush=True)
time.sleep(300)
"""


@pytest.fixture
def running(tmp_path, monkeypatch):
    """A stopped run directory whose lock another process holds, as a `qatune train` training there holds it: the
    process takes the lock under that command line and sleeps."""
    config = config_for(tmp_path)
    path = tmp_path / "c.yaml"
    path.write_text(config.to_yaml(), encoding="utf-8")
    run = tmp_path / "run"
    interrupt_at(monkeypatch, 2)
    with pytest.raises(TrainingInterrupted):
        train(config, output_dir=run, progress=False)
    monkeypatch.undo()
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run), "train", "--config", str(path), "--output-dir",
                             str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "locked\n", proc.communicate()[1]
    yield proc, path, run
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_second_train_resume_or_overwrite_on_a_running_run_is_refused_naming_the_process(running):
    proc, config, run = running
    checkpoints = list_checkpoints(run)
    expected = f"is in use by qatune process {proc.pid}"
    started = time.perf_counter()
    one_line_error(invoke("train", "--config", config, "--output-dir", run, "--quiet"), expected, "train --config")
    assert time.perf_counter() - started < 10                       # refused at once, before any model work
    one_line_error(invoke("train", "--config", config, "--output-dir", run, "--overwrite", "--quiet"), expected)
    one_line_error(invoke("train", "--config", config, "--output-dir", run, "--resume", "--quiet"), expected)
    assert proc.poll() is None and (run / "run.json").is_file()    # the first run was not disturbed
    assert json.loads((run / "run.json").read_text())["status"] == "stopped" and list_checkpoints(run) == checkpoints
    proc.kill()
    proc.wait()
    # A killed process leaves its lock behind: the next command takes it over, and says so. It trains to the
    # end of the epoch its newest checkpoint is in (or the next one, from an epoch's end).
    epochs = json.loads((find_checkpoint(run) / "trainer_state.json").read_text())["epoch"] + 1
    result = invoke("train", "--config", config, "--output-dir", run, "--resume", "--set", f"train.epochs={epochs}",
                    "--quiet")
    assert result.exit_code == 0, result.output + result.stderr
    assert f"taking over the lock of run directory {run.absolute()}: its process {proc.pid}" in result.stderr
    assert json.loads((run / "run.json").read_text())["status"] == "complete"
    assert not (run.parent / ".run.qatune-lock").exists()           # released at the end


def test_export_into_a_folder_being_written_is_refused(tmp_path):
    run = train(config_for(tmp_path, "train.epochs=1"), output_dir=tmp_path / "run", progress=False)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        target = tmp_path / "exported"
        lock = RunLock(target, "export folder")
        lock.path.write_text(json.dumps({"pid": sleeper.pid, "host": os.uname().nodename,
                                         "start_ticks": lock_module._start_ticks(sleeper.pid),
                                         "started": "now", "command": "qatune export"}))
        one_line_error(invoke("export", run, "--merge", target), f"export folder {target.absolute()} is in use "
                       f"by qatune process {sleeper.pid}")
        assert not target.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert invoke("export", run, "--merge", target).exit_code == 0  # the dead owner's lock is taken over
    assert (target / "model.safetensors").is_file()


# --- a full disk ------------------------------------------------------------------------------------

def fail_with_enospc_on(monkeypatch, module, name, call=None, when=None):
    """Make ``module.name`` raise ENOSPC on its ``call``-th call, or on calls whose first argument ``when``
    accepts."""
    real = getattr(module, name)
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call or (when is not None and when(args[0])):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)


def assert_stopped_by_full_disk(err, run, folder_name):
    message = str(err.value)
    assert f"no space left on the disk of {run / 'checkpoints' if folder_name.startswith('step') else run}" in message
    assert f"while writing {folder_name}/ (it needs about " in message and "--resume" in message
    assert json.loads((run / "run.json").read_text())["status"] == "failed"
    leftovers = [p.name for p in run.rglob(".*") if "tmp" in p.name]
    assert leftovers == []


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    from qatune.train import checkpoint as checkpoint_module

    fail_with_enospc_on(monkeypatch, checkpoint_module.torch, "save", 4)   # checkpoint 2: its optimizer.pt
    run = tmp_path / "run"
    with pytest.raises(atomic.DiskFullError) as err:
        train(config_for(tmp_path), output_dir=run, progress=False)
    assert_stopped_by_full_disk(err, run, "step-0000002")
    assert [p.name for p in list_checkpoints(run)] == ["step-0000001"]
    assert find_checkpoint(run).name == "step-0000001"
    monkeypatch.undo()
    resumed = train(config_for(tmp_path), output_dir=run, resume="", progress=False)
    assert json.loads((resumed / "run.json").read_text())["status"] == "complete"


def test_a_full_disk_while_writing_final_leaves_no_final_and_a_resumable_run(tmp_path, monkeypatch):
    # final/ is linked from the last checkpoint; the folder's manifest is written either way.
    fail_with_enospc_on(monkeypatch, atomic, "write_manifest", when=lambda tmp: tmp.name.startswith(".final-"))
    run = tmp_path / "run"
    with pytest.raises(atomic.DiskFullError) as err:
        train(config_for(tmp_path), output_dir=run, progress=False)
    assert_stopped_by_full_disk(err, run, "final")
    assert not (run / "final").exists()
    monkeypatch.undo()
    train(config_for(tmp_path), output_dir=run, resume="", progress=False)
    assert (run / "final" / "model.safetensors").is_file()
    assert json.loads((run / "run.json").read_text())["status"] == "complete"


def test_final_is_copied_where_the_file_system_refuses_hard_links(tmp_path, monkeypatch):
    from qatune.train import checkpoint

    def refuse(*_args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(checkpoint.os, "link", refuse)
    run = train(config_for(tmp_path, "train.epochs=1"), output_dir=tmp_path / "run", progress=False)
    final, last = run / "final" / "model.safetensors", checkpoint.list_checkpoints(run)[-1] / "model.safetensors"
    assert final.read_bytes() == last.read_bytes() and os.stat(final).st_ino != os.stat(last).st_ino
    assert atomic.damage(run / "final") is None


def test_a_full_disk_while_writing_the_report_does_not_fail_the_run(tmp_path, monkeypatch, caplog):
    from qatune.train import report as report_module

    fail_with_enospc_on(monkeypatch, report_module.atomic, "atomic_write_text", when=lambda p: p.name == "report.md")
    run = train(config_for(tmp_path, "train.epochs=1"), output_dir=tmp_path / "run", progress=False)
    assert json.loads((run / "run.json").read_text())["status"] == "complete"
    assert not (run / "report.md").exists() and (run / "final" / "model.safetensors").is_file()


def can_mount_tmpfs(where: Path) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        return False
    subprocess.run(["umount", str(where)], check=True)
    return True


def test_a_real_full_disk_on_a_small_tmpfs(tmp_path):
    """A size-limited filesystem (root only): the disk really fills up while checkpoint 2 is written."""
    disk = tmp_path / "disk"
    if not can_mount_tmpfs(disk):
        pytest.skip("needs root and a mountable tmpfs; the injected-ENOSPC tests above cover this case")
    probe = train(config_for(tmp_path, "train.epochs=1"), output_dir=tmp_path / "probe", progress=False)
    checkpoint = sum(p.stat().st_size for p in list_checkpoints(probe)[0].rglob("*") if p.is_file())
    others = sum(p.stat().st_size for p in probe.glob("*.*") if p.is_file())
    size = others + int(1.6 * checkpoint)      # the run's files and one checkpoint fit, not two
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], check=True)
    try:
        run = disk / "run"
        with pytest.raises(atomic.DiskFullError) as err:
            train(config_for(tmp_path), output_dir=run, progress=False)
        assert "no space left on the disk of" in str(err.value) and "MB free" in str(err.value)
        intact = list_checkpoints(run)
        assert intact and all(find_checkpoint(c) == c for c in intact)   # every checkpoint left is intact
        load_file(intact[-1] / "model.safetensors")
        assert not [p for p in run.rglob(".*") if "tmp" in p.name]
        subprocess.run(["mount", "-o", f"remount,size={size * 20}", str(disk)], check=True)   # space freed
        train(config_for(tmp_path), output_dir=run, resume="", progress=False)
        assert json.loads((run / "run.json").read_text())["status"] == "complete"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# --- a damaged run directory ------------------------------------------------------------------------

@pytest.fixture
def stopped_run(tmp_path, monkeypatch):
    """A run stopped by SIGINT after step 5, with checkpoints step-1 .. step-5."""
    from qatune.train import loop as loop_module

    original = loop_module.train_step

    def stepping(loop, window):
        done = original(loop, window)
        if loop.state.step == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return done

    monkeypatch.setattr(loop_module, "train_step", stepping)
    with pytest.raises(TrainingInterrupted):
        train(config_for(tmp_path), output_dir=tmp_path / "run", progress=False)
    monkeypatch.undo()
    return tmp_path / "run"


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def edit_step(path):
    text = path.read_text()
    assert '"step": 5,' in text
    path.write_text(text.replace('"step": 5,', '"step": 7,'))   # same size: only the checksum tells


@pytest.mark.parametrize(("damage", "file", "says"), [
    (truncate, "model.safetensors", "has {size} bytes"),
    (os.remove, "optimizer.pt", "optimizer.pt is missing"),
    (edit_step, "trainer_state.json", "was changed after it was written"),
])
def test_resume_skips_a_damaged_checkpoint_for_the_newest_intact_one(stopped_run, tmp_path, caplog, damage, file,
                                                                     says):
    newest = stopped_run / "checkpoints" / "step-0000005"
    damage(newest / file)
    size = (newest / file).stat().st_size if (newest / file).exists() else 0
    result = invoke("train", "--config", stopped_run / "config.yaml", "--output-dir", stopped_run, "--resume",
                    "--quiet")
    assert result.exit_code == 0, result.output + result.stderr
    assert f"skipping damaged checkpoint step-0000005: {newest / file}" in result.stderr
    assert says.format(size=size) in result.stderr
    assert "resuming from" in result.stderr and "step-0000004 (step 4" in result.stderr
    assert json.loads((stopped_run / "run.json").read_text())["status"] == "complete"


def test_resume_stops_with_one_line_when_no_checkpoint_is_intact(stopped_run):
    for checkpoint in list_checkpoints(stopped_run):
        truncate(checkpoint / "model.safetensors")
    one_line_error(invoke("train", "--config", stopped_run / "config.yaml", "--output-dir", stopped_run, "--resume"),
                   f"no intact checkpoint to resume in {stopped_run}")
    named = stopped_run / "checkpoints" / "step-0000003"
    one_line_error(invoke("train", "--config", stopped_run / "config.yaml", "--resume", named),
                   f"checkpoint {named} is damaged: {named / 'model.safetensors'} has")
    gone = named.with_name("step-0000099")
    one_line_error(invoke("train", "--config", stopped_run / "config.yaml", "--resume", gone),
                   f"no checkpoint step-0000099 in {named.parent} (it holds step-0000001, step-0000002, step-0000003, "
                   "step-0000004, step-0000005); resume from one of those, or from the run directory for its newest "
                   "intact one")


def test_a_run_json_that_is_not_json_does_not_stop_resume_or_eval(stopped_run):
    (stopped_run / "run.json").write_text("{ this is not json")
    result = invoke("train", "--config", stopped_run / "config.yaml", "--output-dir", stopped_run, "--resume",
                    "--quiet")
    assert result.exit_code == 0, result.output + result.stderr
    assert json.loads((stopped_run / "run.json").read_text())["status"] == "complete"
    assert invoke("eval", stopped_run, "--data", stopped_run.parent / "qa.csv", "--json").exit_code == 0


@pytest.mark.parametrize(("file", "damage", "says"), [
    ("model.safetensors", truncate, "model.safetensors has"),
    ("config.json", lambda p: p.write_text("{"), "config.json has 1 bytes"),
    ("qatune.json", os.remove, "qatune.json is missing"),
])
def test_eval_and_generate_on_a_damaged_final_name_the_file(tmp_path, file, damage, says):
    run = train(config_for(tmp_path, "train.epochs=1"), output_dir=tmp_path / "run", progress=False)
    damage(run / "final" / file)
    if file == "qatune.json":   # without qatune.json the folder is no model folder at all
        one_line_error(invoke("generate", run, "question number 1"), f"{run} has no final/ model")
        return
    one_line_error(invoke("eval", run, "--data", tmp_path / "qa.csv"), f"the model in {run / 'final'} is damaged",
                   says)
    one_line_error(invoke("generate", run, "question number 1"), says)


def test_a_checkpoint_that_loads_with_pickle_is_never_read(stopped_run):
    bad = stopped_run / "checkpoints" / "step-0000005" / "optimizer.pt"
    torch.save({"state": {}, "param_groups": []}, bad)   # replaced: the manifest no longer matches
    result = invoke("train", "--config", stopped_run / "config.yaml", "--output-dir", stopped_run, "--resume",
                    "--quiet")
    assert "skipping damaged checkpoint step-0000005" in result.stderr and result.exit_code == 0


# --- interrupts during validation and the report ------------------------------------------------------

def test_ctrl_c_during_validation_stops_after_the_epoch_checkpoint(tmp_path, monkeypatch):
    real = validation_module.evaluation_parts
    calls = {"n": 0}

    def interrupted_evaluation(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            os.kill(os.getpid(), signal.SIGINT)      # arrives while epoch 1 is being evaluated
        return real(*args, **kwargs)

    monkeypatch.setattr(validation_module, "evaluation_parts", interrupted_evaluation)
    run = tmp_path / "run"
    with pytest.raises(TrainingInterrupted) as err:
        train(config_for(tmp_path, "data.validation_fraction=0.25"), output_dir=run, progress=False)
    assert "at step 3 (after epoch 1)" in str(err.value) and "step-0000003" in str(err.value)
    assert json.loads((run / "run.json").read_text())["status"] == "stopped"
    assert not (run / "final").exists() and (run / "best" / "model.safetensors").is_file()
    state = json.loads((find_checkpoint(run) / "trainer_state.json").read_text())
    assert (state["step"], state["epoch"], state["best"]["epoch"]) == (3, 1, 1)
    monkeypatch.undo()
    train(config_for(tmp_path, "data.validation_fraction=0.25"), output_dir=run, resume="", progress=False)
    assert json.loads((run / "run.json").read_text())["status"] == "complete"


def test_ctrl_c_during_the_report_leaves_a_complete_run(tmp_path, monkeypatch):
    def interrupted_report(run_dir, drawn=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "write_report", interrupted_report)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(config_for(tmp_path, "train.epochs=1"), output_dir=run, progress=False)
    assert json.loads((run / "run.json").read_text())["status"] == "complete"
    assert (run / "final" / "model.safetensors").is_file()
    assert atomic.damage(run / "final") is None
