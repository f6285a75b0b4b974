"""Two processes (gloo on CPU) with batch B each train exactly like one process with batch B and
gradient accumulation 2, evaluate the same (predictions gathered from both, no duplicates), and write
the same run directory layout."""

import json

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from qatune.cli import cli

pytestmark = pytest.mark.slow


def layout(run):
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())


def test_two_processes_match_one_with_accumulation(tmp_path):
    data = tmp_path / "qa.csv"
    data.write_text("question,answer\n" + "".join(f"what is item {i}?,thing {i * 7}\n" for i in range(32)))
    held = tmp_path / "held.csv"
    held.write_text("question,answer\n" + "".join(f"what is item {i}?,thing {i * 7}\n" for i in range(0, 32, 3)))
    config = tmp_path / "c.yaml"
    # fp32: under bf16 one CPU process trains bf16 weights with fp32 masters, two processes use autocast.
    config.write_text(f"""
model: {{scratch: {{n_layer: 1, n_embd: 32, n_head: 2, vocab_size: 300}}}}
data: {{train_file: {data}, eval_file: {held}}}
train: {{epochs: 2, batch_size: 4, logging_steps: 1, learning_rate: 3.0e-3, precision: fp32}}
""")
    two = CliRunner().invoke(cli, ["train", "--config", str(config), "--output-dir", str(tmp_path / "two"),
                                   "--num-processes", "2", "--quiet"])
    assert two.exit_code == 0, two.output + two.stderr
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
    assert json.loads((tmp_path / "two" / "run.json").read_text())["status"] == "complete"
