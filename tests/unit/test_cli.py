"""The click group: commands, exit codes, one clean line per error, the entry points."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from qatune.cli import cli, main
from tests.conftest import ROOT


def run(*args):
    return CliRunner().invoke(cli, list(args))


def test_help_lists_the_commands():
    result = run("--help")
    assert result.exit_code == 0
    for command in ("train", "eval", "generate", "check", "env"):
        assert command in result.output


def test_version():
    result = run("--version")
    assert result.exit_code == 0 and "qatune, version" in result.output


def test_env_reports_versions_and_device(tmp_path, monkeypatch):
    monkeypatch.setenv("QATUNE_CACHE_DIR", str(tmp_path))
    (tmp_path / "gguf" / "model-0123").mkdir(parents=True)
    (tmp_path / "gguf" / "model-0123" / "model.safetensors").write_bytes(b"0" * 3 * 2**20)
    (tmp_path / "gguf" / ".model-4567-tmp-x").mkdir()  # being written: not counted
    result = run("env", "--json")
    assert result.exit_code == 0
    info = json.loads(result.output)
    for key in ("python", "torch", "transformers", "accelerate", "device", "torch_threads"):
        assert key in info
    assert info["gguf_cache"] == f"{tmp_path / 'gguf'} (1 converted, 3 MB)"
    monkeypatch.setenv("QATUNE_CACHE_DIR", "off")
    assert json.loads(run("env", "--json").output)["gguf_cache"] == "off (QATUNE_CACHE_DIR=off)"


def test_config_error_is_one_clean_message(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lerning_rate: 1\n")
    result = run("check", "--config", str(path))
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert "did you mean 'train.learning_rate'?" in result.stderr


def test_verbose_shows_the_traceback(tmp_path):
    result = run("-v", "check", "--config", str(tmp_path / "missing.yaml"))
    assert result.exit_code == 1
    assert "Traceback" in result.stderr and "not found" in result.stderr


def test_main_returns_exit_codes(tmp_path, capsys):
    assert main(["--version"]) == 0
    assert main(["check", "--config", str(tmp_path / "none.yaml")]) == 1
    assert main(["no-such-command"]) == 2
    assert "not found" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "qatune", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "generate" in done.stdout


def test_config_keys_lists_every_key_with_type_and_default():
    from qatune.config import field_names

    result = CliRunner().invoke(cli, ["config", "--keys"])
    assert result.exit_code == 0, result.output
    listed = {line.split()[0] for line in result.stdout.splitlines() if line and not line.startswith(" ")}
    assert set(field_names()) <= listed
    assert "train.learning_rate                float = 5e-05" in result.stdout
    assert "    AdamW peak learning rate." in result.stdout
    assert 'data.max_length                    int | Literal[\'auto\'] = "auto"' in result.stdout


def test_config_prints_the_resolved_config_and_rejects_bad_keys(tmp_path):
    import yaml

    result = CliRunner().invoke(cli, ["config", "--config", str(ROOT / "configs" / "tiny-gpt2.yaml"),
                                      "--set", "train.learning_rate=1e-4"])
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.stdout)
    assert resolved["train"]["learning_rate"] == 1e-4 and resolved["train"]["max_grad_norm"] == 1.0
    bad = CliRunner().invoke(cli, ["config", "--set", "train.lerning_rate=1"])
    assert bad.exit_code == 1 and "did you mean 'train.learning_rate'?" in bad.stderr


def test_a_closed_pipe_is_not_an_internal_error():
    done = subprocess.run(f"{sys.executable} -m qatune config --keys | head -1", shell=True, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.startswith("task ") and "internal error" not in done.stderr and "Traceback" not in done.stderr


def test_an_empty_answer_prints_an_empty_line_and_a_note(monkeypatch):
    import qatune.evaluation.asking

    monkeypatch.setattr(qatune.evaluation.asking, "answer_one", lambda *args, **kwargs: "")
    result = CliRunner().invoke(cli, ["generate", "runs/any", "What is the capital of France?"])
    assert result.exit_code == 0
    assert result.stdout == "\n"
    assert result.stderr == ("note: the model's answer is empty; a model trained longer, or on more rows like this "
                             "question, may answer it\n")
    monkeypatch.setattr(qatune.evaluation.asking, "answer_one", lambda *args, **kwargs: "Paris")
    result = CliRunner().invoke(cli, ["generate", "runs/any", "What is the capital of France?"])
    assert (result.stdout, result.stderr) == ("Paris\n", "")


@pytest.mark.parametrize("code", [0, 3])
def test_console_entry_freezes_the_collector_before_exit(monkeypatch, code):
    import gc

    from qatune import cli

    calls = []
    monkeypatch.setattr(cli, "main", lambda: calls.append("main") or code)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(cli, "exit_without_teardown", lambda c: calls.append(f"exit {c}"))
    assert cli.entry() == code
    assert calls == ["main", "freeze", f"exit {code}"]
