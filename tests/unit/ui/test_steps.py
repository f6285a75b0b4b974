"""What each step runs and what it reads back: the held-out rows compared on, the comparison's rows flips first,
the export's check line, final/ as a zip."""

import csv
import json
import shlex
import shutil
import zipfile
from types import SimpleNamespace

import pytest

from qatune.config import load_config
from qatune.data.spreadsheet import load_from_config, split_validation
from qatune.ui import PageError
from qatune.ui.sheet import Choices, write_page_config
from qatune.ui.steps import (
    compare_args,
    compare_result,
    export_result,
    final_sizes,
    train_args,
    zip_final,
)
from qatune.ui.workspace import Workspace
from tests.conftest import FIXTURES, ROOT


@pytest.fixture
def workspace(tmp_path):
    workspace = Workspace(tmp_path / "ws")
    (workspace.root / "sheets").mkdir()
    shutil.copy(ROOT / "examples" / "data" / "faq.csv", workspace.root / "sheets" / "faq.csv")
    return workspace


def a_run(workspace, **changes):
    """A run directory as training leaves it, as far as these steps read it: its resolved config (a hub model's
    unless said: one with a base to compare with)."""
    written = write_page_config(workspace, Choices(**{"sheet": "faq.csv", "question": "question",
                                                      "answers": ["answer"], "model": "owner/model", "run": "faq",
                                                      **changes}))
    run_dir = workspace.root / written["run"]
    run_dir.mkdir(parents=True)
    config = load_config(workspace.root / written["config"])
    (run_dir / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
    return run_dir, config


def test_train_from_a_config_again_or_resumed():
    assert train_args("configs/faq.yaml", None, False) == ["train", "--config", "configs/faq.yaml"]
    assert train_args("configs/faq.yaml", None, True) == ["train", "--config", "configs/faq.yaml", "--overwrite"]
    assert train_args(None, "runs/faq", False) == ["train", "--resume", "runs/faq"]


def test_compare_on_the_rows_validation_held_out(workspace, monkeypatch):
    run_dir, config = a_run(workspace, held_out=0.2)
    args, _ = compare_args(workspace, "runs/faq", "base", None)
    assert args == ["eval", "runs/faq", "--data", "runs/faq/held-out.csv", "--compare", "base", "--json"]
    monkeypatch.chdir(workspace.root)
    records, _ = load_from_config(config.data, config.data.train_file)
    _, validation = split_validation(records, 0.2, config.seed)
    with open(run_dir / "held-out.csv", encoding="utf-8") as f:
        held_out = list(csv.DictReader(f))
    assert [(r["question"], r["answer"]) for r in held_out] == [(r.question, r.answer) for r in validation]
    assert len(held_out) == 30


def test_compare_on_a_sheet_or_with_another_run_and_nothing_outside(workspace):
    a_run(workspace)
    (workspace.root / "runs" / "older").mkdir()
    args, data = compare_args(workspace, "runs/faq", "runs/older", "faq.csv")
    assert (args[3], args[5], data) == ("sheets/faq.csv", "runs/older", "sheets/faq.csv")
    with pytest.raises(PageError, match="not a path inside the workspace"):
        compare_args(workspace, "runs/faq", "../../elsewhere", None)
    with pytest.raises(PageError, match="no sheet"):
        compare_args(workspace, "runs/faq", "base", "missing.csv")


def test_a_run_without_held_out_rows_asks_for_a_sheet(workspace):
    a_run(workspace, held_out=0.0)
    with pytest.raises(PageError, match="holds no rows out"):
        compare_args(workspace, "runs/faq", "base", None)


def test_a_run_without_a_base_says_why_and_compares_with_another_run(workspace):
    a_run(workspace, model="scratch")
    (workspace.root / "runs" / "older").mkdir()
    with pytest.raises(PageError) as refused:
        compare_args(workspace, "runs/faq", "base", None)
    assert refused.value.status == 409
    assert str(refused.value) == ("runs/faq: a model from scratch knew nothing before training: there is no base to "
                                  "compare with; compare it with another run")
    assert compare_args(workspace, "runs/faq", "runs/older", None)[0][5] == "runs/older"


def test_the_rows_that_flipped_come_first(workspace, tmp_path):
    (workspace.root / "runs" / "faq").mkdir(parents=True)
    rows = [("1", "same"), ("2", "wrong->right"), ("3", "same"), ("4", "right->wrong")]
    with open(workspace.root / "runs" / "faq" / "compare-x.csv", "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([("row", "change"), *rows])
    output = tmp_path / "out.json"
    output.write_text(json.dumps({"exact_match": 50.0, "compare": {"files": {"csv": "runs/faq/compare-x.csv"}}}))
    job = SimpleNamespace(state="done", output_text=output.read_text)
    found = compare_result(workspace, job)
    assert [row["row"] for row in found["rows"]] == ["4", "2", "1", "3"]
    assert found["metrics"] == {"exact_match": 50.0} and found["rows_total"] == 4


def test_the_export_check_line_its_files_and_how_ollama_asks_it(workspace):
    a_run(workspace)
    (workspace.root / "exports").mkdir()
    (workspace.root / "exports" / "faq-f16.Modelfile").write_text(
        'FROM ./faq-f16.gguf\nTEMPLATE """Question: {{ $question }}\nAnswer:"""\n', encoding="utf-8")
    log = ["writing", "check on 15 rows of the run's validation rows of sheets/faq.csv: f16: next-token agreement "
           "100.0% at 402 positions, 4/4 answers identical", "Ollama: ollama create NAME -f exports/faq.Modelfile"]
    job = SimpleNamespace(state="done", log_lines=lambda _count: log, extra={"gguf": "exports/faq-f16.gguf"},
                          target="runs/faq")
    found = export_result(workspace, job)
    assert found["check"]["rows"] == 15 and found["check"]["line"].startswith("f16: next-token agreement 100.0%")
    assert (found["gguf"], found["modelfile"]) == ("exports/faq-f16.gguf", "exports/faq-f16.Modelfile")
    ollama = found["ollama"]
    assert (ollama["name"], ollama["passage"], ollama["create"]) == ("faq-f16", False,
                                                                     "ollama create faq-f16 -f faq-f16.Modelfile")
    config = load_config(workspace.root / "runs" / "faq" / "config.yaml")
    records, _ = load_from_config(config.data, workspace.root / "sheets" / "faq.csv")
    question = split_validation(records, config.data.validation_fraction, config.seed)[1][0].question
    assert shlex.split(ollama["ask"]) == ["ollama", "run", "faq-f16", question]  # a question it did not train on


def test_a_reading_comprehension_export_is_asked_with_the_passage_as_the_system_message(workspace):
    """The exported template reads the passage from the system messages (export/gguf_prompt.py): the page's
    example is an API call that sends a held-out row's passage there, and its question as the user's message."""
    shutil.copy(FIXTURES / "xquad_slice.csv", workspace.root / "sheets" / "rc.csv")
    a_run(workspace, sheet="rc.csv", context="context", task="generative", model="smollm2-135m-instruct", run="rc")
    (workspace.root / "exports").mkdir()
    (workspace.root / "exports" / "rc-q8_0.Modelfile").write_text(
        'FROM ./rc-q8_0.gguf\nTEMPLATE """{{ .System }}\n{{ $question }}"""\n', encoding="utf-8")
    job = SimpleNamespace(state="done", log_lines=lambda _count: [], extra={"gguf": "exports/rc-q8_0.gguf"},
                          target="runs/rc")
    ollama = export_result(workspace, job)["ollama"]
    assert ollama["passage"] is True and ollama["create"] == "ollama create rc-q8_0 -f rc-q8_0.Modelfile"
    curl, url, flag, body = shlex.split(ollama["ask"])
    assert (curl, url, flag) == ("curl", "http://localhost:11434/api/chat", "-d")
    sent = json.loads(body)
    config = load_config(workspace.root / "runs" / "rc" / "config.yaml")
    records, _ = load_from_config(config.data, workspace.root / "sheets" / "rc.csv")
    held_out = split_validation(records, config.data.validation_fraction, config.seed)[1]
    shortest = min(held_out, key=lambda r: len(r.context))
    assert sent == {"model": "rc-q8_0", "stream": False,
                    "messages": [{"role": "system", "content": shortest.context},
                                 {"role": "user", "content": shortest.question}]}


def test_final_as_a_zip(tmp_path):
    final = tmp_path / "run" / "final"
    (final / "sub").mkdir(parents=True)
    (final / "qatune.json").write_text("{}")
    (final / "sub" / "weights.bin").write_bytes(b"\x00" * 10)
    archive = zip_final(tmp_path / "run", tmp_path / "run-final.zip")
    with zipfile.ZipFile(archive) as opened:
        assert sorted(opened.namelist()) == ["final/qatune.json", "final/sub/weights.bin"]
    with pytest.raises(PageError, match="has no final/ model yet"):
        zip_final(tmp_path / "nothing", tmp_path / "x.zip")


def test_final_zipped_with_bf16_weights_loads_with_qatune_and_transformers(tmp_path):
    """The zip's weights are bf16 by default (about half the bytes of final/), its manifest written for what it
    holds; the folder loads with qatune (generate) and transformers as final/ does, in the dtype its config.json
    names, its weights those of the run rounded to bf16."""
    import torch
    from click.testing import CliRunner
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from qatune.cli import cli
    from qatune.model.folder import load_model_folder, save_model
    from qatune.runs.atomic import damage
    from qatune.train import prepare
    from tests.conftest import tiny_config

    config = tiny_config(tmp_path, [(f"what is {n}?", n) for n in ("one", "two", "three", "four")],
                         "model.scratch.n_embd=64", "model.scratch.vocab_size=2000")
    prepared = prepare(config)
    (tmp_path / "run").mkdir()
    save_model(tmp_path / "run" / "final", prepared.model, prepared.tokenizer, config, prepared.info)
    sizes = final_sizes(tmp_path / "run")
    plain = zip_final(tmp_path / "run", tmp_path / "fp32.zip", "fp32")
    small = zip_final(tmp_path / "run", tmp_path / "bf16.zip")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16.zip", "fp32.zip", "qa.csv", "run"]  # nothing left over
    for archive, folder in ((plain, tmp_path / "fp32"), (small, tmp_path / "bf16")):
        with zipfile.ZipFile(archive) as opened:
            opened.extractall(folder)
    unzipped = {dtype: sum(p.stat().st_size for p in (tmp_path / dtype).rglob("*") if p.is_file())
                for dtype in ("fp32", "bf16")}
    assert unzipped["fp32"] == sizes["fp32"] and abs(unzipped["bf16"] - sizes["bf16"]) < 200
    assert unzipped["bf16"] < 0.6 * unzipped["fp32"]
    with safe_open(tmp_path / "bf16" / "final" / "model.safetensors", framework="pt") as opened:
        assert {opened.get_slice(name).get_dtype() for name in opened.keys()} == {"BF16"}
        assert opened.metadata() == {"format": "pt"}
    assert damage(tmp_path / "bf16" / "final") is None  # the manifest is of the bf16 files
    loaded = load_model_folder(tmp_path / "bf16" / "final")
    trained = dict(prepared.model.named_parameters())
    for name, weight in loaded.model.named_parameters():
        assert weight.dtype == torch.float32
        assert torch.equal(weight, trained[name].detach().to(torch.bfloat16).float()), name
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16" / "final").dtype == torch.float32
    answered = CliRunner().invoke(cli, ["generate", str(tmp_path / "bf16" / "final"), "what is one?",
                                        "--max-new-tokens", "4"])
    assert answered.exit_code == 0, answered.output
