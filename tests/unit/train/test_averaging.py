"""train.ema_decay: the moving average by hand, swapped in and out exactly, saved in checkpoints; final/ holds it,
the checkpoint the trained weights, and a resumed run averages exactly as an uninterrupted one."""

import json

import pytest
import torch
from safetensors.torch import load_file

from qatune.errors import RunDirError
from qatune.train import TrainingInterrupted, train
from qatune.train.averaging import FILE, WeightAverage, decay_at
from qatune.train.checkpoint import TRAINER_STATE, find_checkpoint
from tests.conftest import interrupt_at, resume_config


def test_the_average_by_hand_weighs_each_step_by_its_age_and_not_the_starting_weights():
    weights = torch.zeros(2)
    average = WeightAverage([weights], decay=0.5)
    seen = []
    for step, value in enumerate([1.0, 3.0, 5.0, 4.0], start=1):
        weights.fill_(value)
        average.update(step)
        seen.append(value)
        ages = [0.5 ** (step - s) for s in range(1, step + 1)]          # the weights after step s, by their age
        by_hand = sum(a * v for a, v in zip(ages, seen)) / sum(ages)
        torch.testing.assert_close(average.averages[0], torch.full((2,), by_hand))
    assert decay_at(0.5, 1) == 0.0 and decay_at(0.5, 2) == pytest.approx(1 / 3)
    assert decay_at(0.99, 1000) == pytest.approx(0.99)
    assert torch.equal(weights, torch.full((2,), 4.0))  # the trained weights are not touched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swapped_in_then_out_exactly_even_when_the_work_inside_fails(dtype):
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2).to(dtype)
    average = WeightAverage(list(layer.parameters()), decay=0.9)
    for step in (1, 2):
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(1.0)
        average.update(step)
    moved = [p.detach().clone() for p in layer.parameters()]
    averaged = [a.clone() for a in average.averages]
    with pytest.raises(ValueError), average.swapped_in():
        for p, a, m in zip(layer.parameters(), averaged, moved):
            assert torch.equal(p, a.to(dtype)) and not torch.equal(p, m)
        raise ValueError("evaluation failed")
    assert all(torch.equal(p, m) for p, m in zip(layer.parameters(), moved))
    assert all(torch.equal(a, b) for a, b in zip(average.averages, averaged))  # the fp32 average kept exactly


def test_a_checkpoints_average_loads_back_and_a_wrong_one_is_refused(tmp_path):
    weights = [torch.arange(4.0), torch.ones(2, 3)]
    average = WeightAverage(weights, decay=0.9)
    average.averages[0].fill_(7.0)
    average.save(tmp_path)
    other = WeightAverage([torch.zeros(4), torch.zeros(2, 3)], decay=0.9)
    other.load(tmp_path)
    assert torch.equal(other.averages[0], torch.full((4,), 7.0)) and torch.equal(other.averages[1], torch.ones(2, 3))
    with pytest.raises(RunDirError, match="does not match this run's trainable weights"):
        WeightAverage([torch.zeros(5)], decay=0.9).load(tmp_path)
    (tmp_path / FILE).unlink()
    with pytest.raises(RunDirError, match=f"holds no {FILE}.*the checkpoint is incomplete; resume from another one"):
        other.load(tmp_path)


def test_final_holds_the_average_the_checkpoint_the_trained_weights_and_resume_is_exact(tmp_path, monkeypatch):
    config = resume_config(tmp_path, "train.ema_decay=0.8")
    straight = train(config, output_dir=tmp_path / "straight", progress=False)
    last = find_checkpoint(straight)
    final = load_file(straight / "final" / "model.safetensors")
    trained = load_file(last / "model.safetensors")
    averaged = torch.load(last / FILE, weights_only=True)
    assert len(averaged) == len(final)               # every weight of the scratch model is trained, and averaged
    assert all(any(torch.equal(a, f) for f in final.values()) for a in averaged)
    assert not (straight / "final" / FILE).exists()
    differs = [name for name in final if not torch.equal(final[name], trained[name])]
    assert len(differs) == len(final)                 # 9 steps at decay 0.8: no weight is its last step's
    plain = train(resume_config(tmp_path), output_dir=tmp_path / "plain", progress=False)
    assert all(torch.equal(trained[name], t) for name, t in load_file(plain / "final" / "model.safetensors").items())

    interrupt_at(monkeypatch, 4)
    with pytest.raises(TrainingInterrupted):
        train(config, output_dir=tmp_path / "stopped", progress=False)
    monkeypatch.undo()
    resumed = train(config, output_dir=tmp_path / "stopped", resume="", progress=False)
    again = load_file(resumed / "final" / "model.safetensors")
    assert all(torch.equal(final[name], again[name]) for name in final)
    assert json.loads((resumed / "run.json").read_text())["status"] == "complete"


def test_validation_and_best_read_the_average_and_training_goes_on_from_the_trained_weights(tmp_path):
    held_out = ("data.validation_fraction=0.25", "train.best_metric=loss", "train.keep_checkpoints=1")
    averaged = train(resume_config(tmp_path, "train.ema_decay=0.8", *held_out), output_dir=tmp_path / "averaged",
                     progress=False)
    plain = train(resume_config(tmp_path, *held_out), output_dir=tmp_path / "plain", progress=False)
    last = find_checkpoint(averaged)
    at_best = last.parent / json.loads((last / TRAINER_STATE).read_text())["best_checkpoint"]
    best = load_file(averaged / "best" / "model.safetensors")
    saved_average = torch.load(at_best / FILE, weights_only=True)
    assert all(any(torch.equal(a, b) for b in best.values()) for a in saved_average)
    # the average swapped in for every validation never reached training: the trained weights are a plain run's
    plain_last = find_checkpoint(plain)
    assert last.name == plain_last.name
    trained, plain_trained = load_file(last / "model.safetensors"), load_file(plain_last / "model.safetensors")
    assert all(torch.equal(trained[name], plain_trained[name]) for name in trained)
    assert not all(torch.equal(best[name], trained[name]) for name in best)


def test_fsdp_takes_an_average_and_a_sharded_checkpoint_without_one_is_refused_in_one_line(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from qatune.train import sharding

    monkeypatch.setenv("WORLD_SIZE", "2")
    sharding.check_setup(resume_config(tmp_path, "train.distributed=fsdp", "train.ema_decay=0.99"))
    shards = tmp_path / "step-0000003" / "sharded"
    shards.mkdir(parents=True)
    dcp.save({"model": {"w": torch.zeros(2)}}, checkpoint_id=str(shards), no_dist=True)
    with pytest.raises(RunDirError, match=r"^\S+/step-0000003/sharded holds no average of the weights, which "
                                          r"train.ema_decay keeps: the checkpoint was written without it; resume "
                                          r"with the train.ema_decay it was trained with$"):
        layer = torch.nn.Linear(2, 2)
        sharding.load_shards(layer, torch.optim.AdamW(layer.parameters()), shards.parent,
                             average={"weight": torch.zeros(2, 2)})


@pytest.mark.slow  # bf16 matrix products, emulated on a CPU without AVX512-BF16
def test_under_bf16_master_weights_the_fp32_masters_are_averaged(tmp_path):
    config = resume_config(tmp_path, "train.ema_decay=0.8", "train.precision=bf16",
                           "train.speedups=[bf16_master_weights]", "train.device=cpu")
    run = train(config, output_dir=tmp_path / "run", progress=False)
    final = load_file(run / "final" / "model.safetensors")
    averaged = torch.load(find_checkpoint(run) / FILE, weights_only=True)
    assert {t.dtype for t in final.values()} == {t.dtype for t in averaged} == {torch.float32}
    assert all(any(torch.equal(a, f) for f in final.values()) for a in averaged)
    trained = load_file(find_checkpoint(run) / "model.safetensors")
    assert trained.keys() == final.keys() and not any(torch.equal(trained[k], final[k]) for k in final)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_counts_the_average_in_the_space_it_needs_and_writes_it_once(tmp_path, monkeypatch, sharded):
    from qatune.runs import atomic
    from qatune.train.checkpoint import TrainState, save_checkpoint

    layer = torch.nn.Linear(10, 10)  # 110 fp32 weights: 440 bytes, as many for the average
    optimizer = torch.optim.AdamW(layer.parameters())
    layer(torch.ones(1, 10)).sum().backward()
    optimizer.step()  # two fp32 moments per weight and a step count per tensor: 880 + 8 bytes
    asked = {}

    def write_folder(folder, fill, size_hint=0):
        asked["bytes"] = size_hint
        folder.mkdir()
        fill(folder)
        return folder

    monkeypatch.setattr(atomic, "write_folder", write_folder)
    monkeypatch.setattr("qatune.model.folder.write_model_files", lambda *args, **kwargs: None)
    average = WeightAverage(list(layer.parameters()), decay=0.9)
    save_checkpoint(tmp_path, TrainState(), layer, None, None, None, optimizer, {}, keep=1,
                    shards=(lambda folder: None) if sharded else None, average=average)
    assert asked["bytes"] == 440 + 888 + 440
    # a sharded run's average is written by the shards' writer, with the weights' shards; average.pt otherwise
    assert (tmp_path / "checkpoints" / "step-0000000" / FILE).is_file() is not sharded
