"""Two processes (gloo on CPU) with batch B each train exactly like one process with batch B and
gradient accumulation 2, evaluate the same (predictions gathered from both, no duplicates), and write
the same run directory layout, leaving no torchrun folder in the temporary directory; a failure on one process
ends both within seconds, in one line; nothing the run listens on is reachable but from this machine."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from qatune.cli import cli
from tests.conftest import ROOT
from tests.failing_process import error_lines, injected

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def layout(run):
    """The run's files (TensorBoard's file is named after the host and process that wrote it)."""
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and p.parent.name != "tensorboard")


def write_config(tmp_path):
    data = tmp_path / "qa.csv"
    data.write_text("question,answer\n" + "".join(f"what is item {i}?,thing {i * 7}\n" for i in range(32)))
    held = tmp_path / "held.csv"
    held.write_text("question,answer\n" + "".join(f"what is item {i}?,thing {i * 7}\n" for i in range(0, 32, 3)))
    config = tmp_path / "c.yaml"
    # fp32: under bf16 one CPU process trains bf16 weights with fp32 masters, two processes use autocast.
    config.write_text(f"""
model: {{scratch: {{n_layer: 1, n_embd: 32, n_head: 2, vocab_size: 300}}}}
data: {{train_file: {data}, eval_file: {held}}}
train: {{epochs: 2, batch_size: 4, logging_steps: 1, learning_rate: 3.0e-3, precision: fp32, report_to: tensorboard}}
""")
    return config


def test_two_processes_match_one_with_accumulation(tmp_path, monkeypatch, capfd):
    config = write_config(tmp_path)
    temporary = tmp_path / "temporary"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))  # the launched processes' temporary directory
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    two = CliRunner().invoke(cli, ["train", "--config", str(config), "--output-dir", str(tmp_path / "two"),
                                   "--num-processes", "2"])
    assert two.exit_code == 0, two.output + two.stderr
    bar = capfd.readouterr().err  # the first process's progress bar counts the steps each process takes
    assert re.search(r"train: 100%\S* 8/8 \[", bar) and " 8/16 " not in bar, bar[-2000:]
    assert "OMP_NUM_THREADS" not in bar  # torchrun's warning that it gave each process one thread
    one = CliRunner().invoke(cli, ["train", "--config", str(config), "--output-dir", str(tmp_path / "one"),
                                   "--set", "train.gradient_accumulation_steps=2", "--quiet"])
    assert one.exit_code == 0, one.output + one.stderr
    losses, evals = {}, {}
    for name in ("one", "two"):
        lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [(x["step"], x["loss"]) for x in lines if x["event"] == "train"]
        evals[name] = [x for x in lines if x["event"] == "eval"]
    assert [e["num_examples"] for e in evals["two"]] == [11, 11]       # every held-out row once, none twice
    for a, b in zip(evals["one"], evals["two"], strict=True):
        assert (a["exact_match"], a["f1"]) == (b["exact_match"], b["f1"])
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * a["loss"]
    assert [s for s, _ in losses["two"]] == list(range(1, 9))          # 8 steps, each logged once
    for (s1, l1), (s2, l2) in zip(losses["one"], losses["two"], strict=True):
        assert s1 == s2 and abs(l1 - l2) <= 1e-4 * abs(l1)
    a = load_file(tmp_path / "one" / "final" / "model.safetensors")
    b = load_file(tmp_path / "two" / "final" / "model.safetensors")
    assert all((a[k] - b[k]).abs().max() < 1e-4 for k in a)
    assert layout(tmp_path / "one") == layout(tmp_path / "two")
    # Only the first process logs: one TensorBoard file, each step in it once.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert len(list((tmp_path / "two" / "tensorboard").glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(tmp_path / "two" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 9))
    assert json.loads((tmp_path / "two" / "run.json").read_text())["status"] == "complete"
    assert not [*temporary.glob("torchelastic_*"), *temporary.glob("qatune-torchrun-*")]  # torchrun's went with it


def test_two_processes_average_the_weights_as_one_does(tmp_path):
    config = write_config(tmp_path)
    runs = {"two": ["--num-processes", "2"], "one": ["--set", "train.gradient_accumulation_steps=2"],
            "plain": ["--num-processes", "2", "--set", "train.ema_decay=null"]}
    for name, extra in runs.items():
        done = CliRunner().invoke(cli, ["train", "--config", str(config), "--output-dir", str(tmp_path / name),
                                        "--set", "train.ema_decay=0.9", *extra, "--quiet"])
        assert done.exit_code == 0, done.output + done.stderr
    a, b, plain = (load_file(tmp_path / name / "final" / "model.safetensors") for name in ("one", "two", "plain"))
    assert all((a[k] - b[k]).abs().max() < 1e-4 for k in a)
    assert all((plain[k] - b[k]).abs().max() > 1e-3 for k in b)       # the average, not the last weights
    evals = [[json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()] for name in runs]
    one_eval, two_eval = ([(x["exact_match"], round(x["loss"], 4)) for x in lines if x["event"] == "eval"]
                          for lines in evals[:2])
    assert one_eval == two_eval and len(one_eval) == 2


def test_a_failure_on_one_process_ends_both_in_one_line(tmp_path):
    """Process 1 fails as it starts evaluating, while process 0 is busy with its own share of the held-out rows
    (outside any collective, where it used to go on, take torchrun's SIGTERM for a stop asked for, and be killed
    30 s later with run.json saying running): both end within seconds, with process 1's message in one line."""
    run = tmp_path / "run"
    temporary = tmp_path / "temporary"
    temporary.mkdir()
    env = injected(tmp_path, (1, "qatune.train.loop:evaluate_epoch", "raise"),
                   (0, "qatune.train.loop:evaluate_epoch", "sleep")) | {"TMPDIR": str(temporary)}
    done = subprocess.run([sys.executable, "-m", "qatune", "train", "--config", str(write_config(tmp_path)),
                           "--output-dir", str(run), "--quiet", "--num-processes", "2"], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=600, check=False)
    seconds = time.time() - float((tmp_path / "failed_at").read_text())
    message = ("process 1 of 2 failed: internal error: RuntimeError: injected failure in evaluate_epoch (run with -v "
               "for the traceback; please report it with the output of 'qatune env')")
    assert error_lines(done.stderr) == [f"error: {message}"], done.stderr
    assert done.returncode == 2
    assert seconds < 30, f"the processes ended {seconds:.1f} s after the failure"
    assert "SIGTERM" not in done.stderr and "Traceback" not in done.stderr
    status = json.loads((run / "run.json").read_text())
    assert (status["status"], status["error"]) == ("failed", message)
    assert not [*temporary.glob("torchelastic_*"), *temporary.glob("qatune-torchrun-*")]  # torchrun's went with it
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    print(f"both processes ended {seconds:.1f} s after the failure")


def test_an_error_every_process_meets_is_said_once(tmp_path):
    """A data file missing: each process meets it as it starts (before any process group), and one line says it."""
    done = subprocess.run([sys.executable, "-m", "qatune", "train", "--config", str(write_config(tmp_path)),
                           "--output-dir", str(tmp_path / "run"), "--num-processes", "2", "--set",
                           f"data.train_file={tmp_path / 'gone.csv'}"], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert error_lines(done.stderr) == [f"error: data file {tmp_path / 'gone.csv'} not found; check data.train_file / "
                                        "data.eval_file or the path you passed"], done.stderr
    assert not (tmp_path / "run").exists()


def test_every_port_a_run_on_one_machine_opens_is_on_loopback(tmp_path):
    """torchrun's store that the processes share and each process's gloo connections listen on 127.0.0.1 only
    (torchrun --standalone's stores listen on every interface, and its agent unpickles the rendezvous state it
    reads from one of them: anyone on the network could run code as the user)."""
    run = tmp_path / "run"
    # Both processes wait in their first evaluation, everything open.
    temporary = tmp_path / "temporary"  # torchrun's folder, left there by the kill below
    temporary.mkdir()
    env = injected(tmp_path, (0, "qatune.train.loop:evaluate_epoch", "sleep"),
                   (1, "qatune.train.loop:evaluate_epoch", "sleep")) | {"TMPDIR": str(temporary)}
    said = tmp_path / "stderr.txt"
    with open(said, "w") as stderr:
        launcher = subprocess.Popen([sys.executable, "-m", "qatune", "train", "--config",
                                     str(write_config(tmp_path)), "--output-dir", str(run), "--quiet",
                                     "--num-processes", "2"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                    stderr=stderr)
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").exists() or len((run / "metrics.jsonl").read_text().splitlines()) < 4:
            assert launcher.poll() is None and time.monotonic() < deadline, said.read_text()
            time.sleep(0.5)
        time.sleep(1)
        processes = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(recursive=True)]
        listening = {(c.laddr.ip, c.laddr.port, p.pid) for p in processes
                     for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    finally:
        for process in reversed(psutil.Process(launcher.pid).children(recursive=True)):
            process.kill()
        launcher.kill()
        launcher.wait()
    assert len({pid for _, _, pid in listening}) == 3, listening  # torchrun's agent and the two processes
    assert {address for address, _, _ in listening} == {"127.0.0.1"}, listening


def stop_a_run(tmp_path, arguments, lines, signalled):
    """Start ``qatune train ARGUMENTS --num-processes 2`` in a group of its own, send a signal with ``signalled``
    (given the command's process) once the run's metrics.jsonl has ``lines`` lines, wait for it: its exit code and
    stderr."""
    run, temporary = tmp_path / "run", tmp_path / "temporary"
    temporary.mkdir(exist_ok=True)
    said = tmp_path / "stderr.txt"
    with open(said, "w") as stderr:
        command = subprocess.Popen([sys.executable, "-m", "qatune", "train", *arguments, "--quiet", "--num-processes",
                                    "2"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                                   env={**os.environ, "TMPDIR": str(temporary)}, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").exists() or len((run / "metrics.jsonl").read_text().splitlines()) < lines:
            assert command.poll() is None and time.monotonic() < deadline, said.read_text()
            time.sleep(0.5)
        signalled(psutil.Process(command.pid))
        code = command.wait(timeout=120)
    finally:
        if command.poll() is None:  # it did not end: its processes, and none of this test process's others
            for process in [*psutil.Process(command.pid).children(recursive=True), psutil.Process(command.pid)]:
                process.kill()
    assert not [*temporary.glob("torchelastic_*"), *temporary.glob("qatune-torchrun-*")]  # torchrun's went with it
    return code, said.read_text()


def test_a_stop_saves_a_checkpoint_and_ends_in_the_line_that_resumes(tmp_path):
    """A terminal's Ctrl-C goes to the command's process group: the command (which passes it on) and torchrun's agent
    (which passes it on to the training processes, each in a group of its own); kill (or a container's stop) sends
    SIGTERM to the command alone; a scheduler's SIGTERM may reach one training process alone. Each time every process
    finishes the same step, the checkpoint is saved, the command waits for them and ends with 130 in one line, with
    no traceback and nothing left over; the run resumes from that step."""
    config = write_config(tmp_path)
    config.write_text(config.read_text().replace("epochs: 2", "epochs: 500"))
    run = tmp_path / "run"
    stopped_at = []
    ctrl_c = lambda command: os.killpg(command.pid, signal.SIGINT)  # noqa: E731
    kill = lambda command: command.send_signal(signal.SIGTERM)  # noqa: E731
    second_process = lambda command: next(  # noqa: E731
        p for p in command.children(recursive=True) if p.environ().get("RANK") == "1").send_signal(signal.SIGTERM)
    for arguments, signalled, name in [(["--config", str(config), "--output-dir", str(run)], ctrl_c, "SIGINT"),
                                       (["--resume", str(run)], kill, "SIGTERM"),
                                       (["--resume", str(run)], second_process, "SIGTERM")]:
        logged = len((run / "metrics.jsonl").read_text().splitlines()) if run.exists() else 0
        code, said = stop_a_run(tmp_path, arguments, logged + 6, signalled)  # in training, a few steps on
        stopped = error_lines(said)
        assert code == 130 and len(stopped) == 1 and "Traceback" not in said, said
        line = re.fullmatch(rf"error: training stopped by {name} at step (\d+) \((in|after) epoch \d+\); checkpoint "
                            r"saved in (\S+); resume with: qatune train --resume (\S+) --num-processes 2", stopped[0])
        assert line and line[4] == str(run), stopped
        assert (Path(line[3]) / "trainer_state.json").exists() and Path(line[3]).name == f"step-{int(line[1]):07d}"
        assert json.loads((run / "run.json").read_text())["status"] == "stopped"
        stopped_at.append(int(line[1]))
    assert stopped_at == sorted(set(stopped_at)), stopped_at
