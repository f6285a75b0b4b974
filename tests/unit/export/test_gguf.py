"""qatune export --gguf on tiny runs: a GPT-2 (plain prompt, scratch byte-level tokenizer), a Llama with grouped-query
attention and a ChatML chat template (the context as the system message), and a LoRA run; each written, read back
by transformers' GGUF loader and asked the run's questions; a file written wrong is refused."""

import csv
import json

import pytest

from qatune.data.templates import PromptTemplate
from qatune.export import gguf_write
from qatune.export.gguf import ExportError, export_gguf
from qatune.model.folder import load_model_folder
from tests.conftest import LOCAL, chat_tokenizer, cli_ok, tiny_llama
from tests.serve_runs import train_run

pytest.importorskip("gguf")
pytestmark = pytest.mark.slow

COLOURS = ["red", "blue", "green", "black", "white", "pink", "grey", "brown", "gold", "teal", "navy", "lime"]
CONTEXT_ROWS = [{"question": f"what colour is thing {i}?", "context": f"thing {i} is {c} and round.", "answer": c}
                for i, c in enumerate(COLOURS)]


def chat_run(tmp, build, epochs=40):
    """A tiny chat model (``build(tokenizer)``) with SmolLM2's chat template, trained on CONTEXT_ROWS until it
    answers; returns the run directory (its data beside it, colours.csv)."""
    texts = [f"user assistant system Question: {r['question']} {r['context']}" for r in CONTEXT_ROWS] * 3
    tokenizer = chat_tokenizer(texts, vocab_size=500)
    folder = tmp / "tiny-chat-model"
    build(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = tmp / "colours.csv"
    with open(data, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "context", "answer"])
        writer.writeheader()
        writer.writerows(CONTEXT_ROWS)
    config = tmp / "config.yaml"
    config.write_text(f"""
task: generative
model: {{name_or_path: {folder}}}
data: {{train_file: {data}, context_column: context, system_prompt: ""}}
train: {{epochs: {epochs}, batch_size: 4, learning_rate: 1.0e-2, weight_decay: 0.0, warmup_steps: 5, precision: fp32}}
generate: {{max_new_tokens: 8}}
""", encoding="utf-8")
    cli_ok("train", "--config", config, "--output-dir", tmp / "run", "--quiet")
    return tmp / "run"


def tiny(kind):
    """A one-layer Qwen2 (biases on queries, keys and values) or Mistral, with grouped-query attention."""
    import torch
    import transformers

    def build(tokenizer):
        torch.manual_seed(0)
        config = getattr(transformers, f"{kind}Config")(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)
        return getattr(transformers, f"{kind}ForCausalLM")(config)

    return build


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A tiny Llama (4 query heads, 2 key/value heads, tied embeddings) with SmolLM2's chat template."""
    return chat_run(tmp_path_factory.mktemp("llama"), tiny_llama)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    return train_run("lora", tmp_path_factory.mktemp("lora"))


def run_answers(run, check_rows):
    loaded = load_model_folder(run)
    from qatune.kinds import answer_questions

    return answer_questions(loaded.model, loaded.tokenizer, loaded.info, [r.question for r in check_rows],
                            [r.context for r in check_rows])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("quant", ["f32", "f16", "q8_0"])
def test_written_file_reads_back_and_answers_as_the_run(kind, quant, serve_run, llama_run, tmp_path):
    run = serve_run if kind == "gpt2" else llama_run
    path, check = export_gguf(run, tmp_path / f"{kind}.gguf", quant)
    assert path.is_file() and path.with_suffix(".Modelfile").is_file()
    assert check.passed() and check.rows == (32 if kind == "gpt2" else 12) and check.answer_rows == 4
    assert check.prompts_identical == check.rows  # chat template and tokenizer give the run's prompt, id for id
    assert check.next_tokens_as_rounded == check.positions  # exactly the run's weights at that precision
    if quant in ("f32", "f16"):
        assert check.answers_identical == check.answer_rows
    if quant == "f32":
        assert check.next_tokens_agreeing == check.positions
    saved = json.loads((run / f"export-{kind}.json").read_text())
    assert saved["passed"] and saved["line"] == check.line() and saved["quant"] == quant
    # What llama.cpp reads from the file.
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    value = {key: fields[key].contents() for key in fields if not key.startswith("tokenizer.ggml.t")
             and key != "tokenizer.ggml.merges"}
    assert value["general.architecture"] == ("gpt2" if kind == "gpt2" else "llama")
    assert value["tokenizer.ggml.model"] == "gpt2" and value["tokenizer.ggml.pre"] == "gpt-2"
    assert value["general.file_type"] == int(gguf_write._file_type(quant))
    loaded = load_model_folder(run)
    assert value["tokenizer.ggml.eos_token_id"] == loaded.tokenizer.eos_token_id
    assert len(fields["tokenizer.ggml.tokens"].data) == loaded.model.config.vocab_size
    if kind == "gpt2":
        assert value["gpt2.context_length"] == loaded.model.config.n_positions == 128  # not GPT-2's 1,024
    else:
        assert value["llama.attention.head_count_kv"] == 2 and value["llama.attention.head_count"] == 4
        # The end of the assistant's turn ends generation (here the EOS itself, so no separate end-of-turn id).
        assert value["tokenizer.ggml.eos_token_id"] == loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert "tokenizer.ggml.eot_token_id" not in value


def exported_prompts(llama_run, serve_run, tmp_path):
    """Per run (a chat run with a context, a plain-template run): its exported file, Modelfile text, the
    conversations a client sends for a few rows (a client's own system prompt to the run without a passage) and
    the prompts qatune trained with for them."""
    for name, run, rows in (("chat", llama_run, CONTEXT_ROWS[:3]),
                            ("plain", serve_run, [{"question": "who wrote it?", "context": None, "answer": "me"}])):
        path, _ = export_gguf(run, tmp_path / f"{name}.gguf", "f32", rows=3, answer_rows=1)
        info = load_model_folder(run).info
        template = PromptTemplate(info.prompt_template, info.answer_prefix)
        conversations = [[*([{"role": "system", "content": row["context"]}] if row["context"] else
                            [{"role": "system", "content": "You are a helpful assistant."}]),
                          {"role": "user", "content": row["question"]}] for row in rows]
        yield name, path, path.with_suffix(".Modelfile").read_text(), conversations, [
            template.render(row["question"], row["context"]) for row in rows]


def test_modelfile_and_chat_template_render_the_training_prompt(llama_run, serve_run, tmp_path):
    """The file's chat template, read back by transformers, renders byte for byte the text qatune trains with;
    a chat client's own system prompt does not change the prompt of a run without a passage."""
    from qatune.model.gguf_file import load_gguf_run

    for name, path, modelfile, conversations, trained in exported_prompts(llama_run, serve_run, tmp_path):
        assert modelfile.startswith(f"FROM ./{name}.gguf\n")
        reread = load_gguf_run(path, device="cpu")
        assert [reread.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                for m in conversations] == trained
        stops = [line for line in modelfile.splitlines() if line.startswith("PARAMETER stop")]
        assert stops == (['PARAMETER stop "<|im_end|>"'] if name == "chat" else ['PARAMETER stop "<|endoftext|>"'])
        assert "PARAMETER temperature 0" in modelfile


def test_the_files_template_renders_the_training_prompt_in_other_engines(llama_run, serve_run, tmp_path, hf_jinja,
                                                                          ollama_go):
    """The chat template read from the file, rendered by @huggingface/jinja, and the Modelfile's TEMPLATE, run by
    Go's text/template as Ollama runs it: byte for byte the text qatune trains with."""
    import gguf

    for _, path, modelfile, conversations, trained in exported_prompts(llama_run, serve_run, tmp_path):
        embedded = gguf.GGUFReader(str(path)).fields["tokenizer.chat_template"].contents()
        assert hf_jinja(embedded, conversations) == trained
        assert ollama_go(modelfile, conversations) == trained


def test_the_file_holds_names_not_the_users_paths(llama_run, tmp_path):
    """The run's config travels in the file with its data files' and folders' names, not where they were: no
    absolute path of the test's folders in any of the file's metadata."""
    import gguf
    import yaml

    from qatune.model.gguf_file import CONFIG_KEY

    path, _ = export_gguf(llama_run, tmp_path / "colours.gguf", "f32", rows=2, answer_rows=1)
    assert "/" in load_model_folder(llama_run).config.data.train_file  # the run names it by its absolute path
    fields = gguf.GGUFReader(str(path)).fields
    texts = [str(field.contents()) for key, field in fields.items() if key not in ("tokenizer.ggml.tokens",
                                                                                  "tokenizer.ggml.merges")]
    for folder in (llama_run.parent, tmp_path):
        assert not [text for text in texts if str(folder) in text]
    config = yaml.safe_load(fields[CONFIG_KEY].contents())
    assert (config["model"]["name_or_path"], config["data"]["train_file"], config["output_dir"]) == (
        "tiny-chat-model", "colours.csv", "run")
    assert config["train"]["epochs"] == 40 and config["data"]["context_column"] == "context"


def test_lora_run_is_merged_into_the_file(lora_run, tmp_path):
    path, check = export_gguf(lora_run, tmp_path / "lora.gguf", "f16")
    assert check.passed() and check.answers_identical == check.answer_rows == 4 and check.rows == 32
    import gguf

    names = [t.name for t in gguf.GGUFReader(str(path)).tensors]
    assert not any("lora" in name for name in names) and "blk.0.attn_qkv.weight" in names


def test_eval_generate_and_train_take_the_file(llama_run, tmp_path):
    """The f32 file scores, answers and fine-tunes as the run: eval's metrics equal, its files beside the file."""
    path, _ = export_gguf(llama_run, tmp_path / "colours.gguf", "f32")
    data = llama_run.parent / "colours.csv"
    from_run = json.loads(cli_ok("eval", llama_run, "--data", data, "--json").stdout)
    from_file = json.loads(cli_ok("eval", path, "--data", data, "--json").stdout)
    assert from_file["exact_match"] == from_run["exact_match"] >= 75 and from_file["f1"] == from_run["f1"]
    assert from_file["loss"] == pytest.approx(from_run["loss"], rel=1e-4)
    assert (tmp_path / "eval-colours-colours.json").is_file()
    assert (tmp_path / "predictions-colours-colours.csv").is_file()
    asked = ("what colour is thing 4?", "--context", "thing 4 is white and round.")
    answer = cli_ok("generate", llama_run, *asked).stdout.strip()
    assert answer in COLOURS
    assert cli_ok("generate", path, *asked).stdout.strip() == answer
    assert cli_ok("generate", tmp_path, *asked).stdout.strip() == answer  # a folder holding one .gguf file
    out = cli_ok("generate", path, "--file", data).stdout.strip()
    assert out == str(tmp_path / "answers-colours-colours.csv")
    by_run = cli_ok("generate", llama_run, "--file", data, "--output", tmp_path / "by-run.csv").stdout.strip()
    with open(out, encoding="utf-8") as f, open(by_run, encoding="utf-8") as g:
        assert [row["answer"] for row in csv.DictReader(f)] == [row["answer"] for row in csv.DictReader(g)]
    # Fine-tuned again from the file: the same prompt, and it starts from what the run learnt.
    config = tmp_path / "again.yaml"
    config.write_text(f"""
task: generative
model: {{name_or_path: {path}}}
data: {{train_file: {data}, context_column: context}}
train: {{epochs: 1, batch_size: 4, learning_rate: 1.0e-4, precision: fp32, logging_steps: 1}}
""", encoding="utf-8")
    cli_ok("train", "--config", config, "--output-dir", tmp_path / "again", "--quiet")
    assert (json.loads((tmp_path / "again" / "final" / "qatune.json").read_text())["prompt_template"]
            == load_model_folder(llama_run).info.prompt_template)
    first_loss = json.loads((tmp_path / "again" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    started = json.loads((llama_run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert first_loss < started / 10


def test_a_file_written_wrong_is_refused_and_not_left(llama_run, tmp_path, monkeypatch):
    """Keys' rows left in transformers' order (llama.cpp's rope reads them permuted): the check fails, says how,
    and nothing is written."""
    monkeypatch.setattr(gguf_write, "_permute", lambda weights, heads: weights)
    with pytest.raises(ExportError, match=r"does not answer as the run does: .*next tokens as the run's weights "
                                          r".*first differing (answer|next token): .*nothing was written"):
        export_gguf(llama_run, tmp_path / "wrong.gguf", "f32")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    saved = json.loads((llama_run / "export-wrong.json").read_text())
    assert not saved["passed"] and saved["first_difference"]["run"] != saved["first_difference"]["file"]


@pytest.mark.parametrize("kind", ["seq2seq", "extractive"])
def test_runs_llama_cpp_cannot_hold_are_refused(kind, tmp_path):
    run = train_run(kind, tmp_path, epochs=1)
    from click.testing import CliRunner

    from qatune.cli import cli

    done = CliRunner().invoke(cli, ["export", str(run), "--gguf", str(tmp_path / "x.gguf")])
    assert done.exit_code == 1
    why = "encoder-decoder model (T5)" if kind == "seq2seq" else "extractive model"
    assert f"cannot export {run} as GGUF: it is an {why}" in done.stderr
    assert f"qatune export {run} --merge FOLDER" in done.stderr and "Traceback" not in done.output + done.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_serve_takes_the_file(llama_run, tmp_path):
    """qatune serve on a .gguf file: named after it, answering as the run, its own evaluations on the page."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from qatune.inference.run_model import load_run_model
    from qatune.serve.app import Settings, create_app

    path, _ = export_gguf(llama_run, tmp_path / "colours.gguf", "f32")
    data = llama_run.parent / "colours.csv"
    cli_ok("eval", path, "--data", data)
    # The results of another file beside it, colours-b.gguf, whose name starts like this one's.
    (tmp_path / "eval-colours-b-colours.json").write_text(json.dumps({"exact_match": 1.0, "model_id": "0" * 16}))
    row = CONTEXT_ROWS[5]
    expected = cli_ok("generate", llama_run, row["question"], "--context", row["context"]).stdout.strip()
    with TestClient(create_app(load_run_model(path, device="cpu"), Settings()), base_url=LOCAL) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["colours"]
        reply = client.post("/v1/chat/completions", json={"messages": [
            {"role": "system", "content": row["context"]}, {"role": "user", "content": row["question"]}],
            "temperature": 0}).json()
        assert reply["choices"][0]["message"]["content"] == expected
        summary = client.get("/run").json()
        assert list(summary["evaluations"]) == ["colours"] and summary["evaluations"]["colours"]["exact_match"] >= 75


@pytest.mark.parametrize(("kind", "arch"), [("Qwen2", "qwen2"), ("Mistral", "llama")])
def test_qwen2_and_mistral_runs(kind, arch, tmp_path):
    run = chat_run(tmp_path, tiny(kind), epochs=30)
    path, check = export_gguf(run, tmp_path / f"{arch}.gguf", "f16")
    assert check.passed() and check.prompts_identical == check.rows == 12
    assert check.answers_identical == check.answer_rows and check.next_tokens_as_rounded == check.positions
    import gguf

    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == arch
    # transformers gives a Qwen2 run Qwen2's own split expression, which llama.cpp knows as "qwen2"
    assert reader.fields["tokenizer.ggml.pre"].contents() == ("qwen2" if kind == "Qwen2" else "gpt-2")
    names = {t.name for t in reader.tensors}
    assert "output.weight" in names  # untied: the output layer is its own tensor
    assert ("blk.0.attn_q.bias" in names) == (kind == "Qwen2")
