"""The speed paths on a CUDA GPU (bench/gpu.sh runs these; skipped without one): their checks run on the device
under the run's autocast, a run trains the same losses with them as without, and auto leaves them off."""

import json
import logging
import math

import pytest
import torch

from qatune.model.objectives import CausalLMObjective
from qatune.speedups import NAMES, Speedups
from qatune.speedups.causal import SupervisedRowsObjective
from tests.conftest import speedups_on, tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROWS = [(f"what is said of thing {i}?", f"thing {i} is {word}") for i, word in enumerate(
    ["red", "blue", "green", "apple", "river", "stone", "cloud", "north", "seven", "paper", "glass", "tiger"])]


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=100))


def batch_on(device):
    """Three rows sharing a 3-token prefix, one padded; answers supervised."""
    ids = torch.tensor([[7, 8, 9, 11, 12, 13, 21, 22, 0], [7, 8, 9, 14, 15, 31, 32, 33, 0],
                        [7, 8, 9, 16, 41, 0, 0, 0, 0]], device=device)
    mask = (torch.arange(9, device=device) < torch.tensor([[9], [9], [6]], device=device)).long()
    labels = torch.full_like(ids, -100)
    labels[0, 6:], labels[1, 5:], labels[2, 4:6] = ids[0, 6:], ids[1, 5:], ids[2, 4:6]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "shared_prefix": 3}


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_listed_paths_pass_their_checks_on_the_gpu_and_give_the_models_loss(build, precision):
    model = build()
    speedups = Speedups(list(NAMES), precision, "cuda")
    objective = speedups.attach(model, CausalLMObjective(model))
    assert next(model.parameters()).device.type == "cuda"
    assert isinstance(objective, SupervisedRowsObjective) and "supervised_head" in objective.paths, speedups.reasons
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    batch = batch_on("cuda")
    with torch.autocast("cuda", dtype=dtype, enabled=precision == "bf16"), torch.no_grad():
        mine = objective(**batch)["loss_sum"].float()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        targets = batch["labels"][:, 1:]
        theirs = torch.nn.functional.cross_entropy(logits[targets != -100].float(), targets[targets != -100],
                                                   reduction="sum")
    tolerance = 2e-2 if precision == "bf16" else 1e-4
    assert math.isclose(float(mine), float(theirs), rel_tol=tolerance), (float(mine), float(theirs))


def test_auto_turns_every_path_off_on_a_gpu(tmp_path, caplog):
    from qatune.train import fit, prepare

    config = tiny_config(tmp_path, ROWS, "train.epochs=1", "train.device=cuda")
    with caplog.at_level(logging.INFO, logger="qatune"):
        fit(prepare(config), None, progress=False)
    assert speedups_on(caplog) == []


def test_a_gpu_run_with_every_path_listed_trains_the_losses_of_one_without(tmp_path, caplog):
    from qatune.train import train

    losses = {}
    for name, setting in (("off", "off"), ("listed", "[" + ",".join(NAMES) + "]")):
        config = tiny_config(tmp_path, ROWS, "train.epochs=3", "train.batch_size=4", "train.learning_rate=3e-3",
                             "train.device=cuda", "train.precision=fp32", f"train.speedups={setting}")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="qatune"):
            run = train(config, output_dir=tmp_path / name, progress=False)
        losses[name] = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
                        if json.loads(line).get("event") == "train"]
        if name == "listed":
            assert {"last_column", "supervised_head", "gpt2_supervised_rows"} <= set(speedups_on(caplog))
    assert len(losses["off"]) == len(losses["listed"]) >= 9
    for a, b in zip(losses["off"], losses["listed"], strict=True):
        assert math.isclose(a, b, rel_tol=1e-4), (a, b)
