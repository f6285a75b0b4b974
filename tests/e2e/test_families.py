"""Each model family qatune knows (qatune.model.families) through the commands, as a user with a local folder of that
family runs them: a tiny random model built from the family's transformers config, with a tokenizer of its kind and
its own chat template (tests/families.py), checked, trained in full and with LoRA on the targets its record names,
asked freely and held to a passage, evaluated, served, and exported to GGUF where qatune writes the family. The
check needs no training and runs in the fast suite; the cells on a trained run are marked slow."""

import csv
import json
from pathlib import Path

import pytest

from qatune.model.families import family_of
from tests.conftest import LOCAL, cli_ok
from tests.families import CASES, family_setup, sheet_rows

ROWS = 8


@pytest.fixture(scope="module", params=CASES, ids=[case.id for case in CASES])
def setup(request, tmp_path_factory):
    """(case, model folder, config file, rows file) of one family."""
    case = request.param
    return (case, *family_setup(case, tmp_path_factory.mktemp(case.id), ROWS))


@pytest.fixture(scope="module")
def family(setup):
    """(case, model folder, config file, trained run, rows file) of one family: trained in full."""
    case, folder, config, data = setup
    run = Path(cli_ok("train", "--config", config, "--quiet").stdout.strip().splitlines()[-1])
    return case, folder, config, run, data


def test_check_trains_the_family_chat_prompt_and_its_end_of_turn(setup):
    case, folder, config, _ = setup
    report = json.loads(cli_ok("check", "--config", config, "--json").stdout)
    from transformers import AutoConfig

    written = family_of(AutoConfig.from_pretrained(folder)).gguf_written  # said at check time, before training
    assert any(f["code"] == "gguf" for f in report["findings"]) is (not written)
    assert report["supervision"]["eos_supervised"]
    assert report["supervision"]["end_token"] == case.end_of_turn
    row = sheet_rows(1)[0]
    shown = report["examples"][0]
    prompt, trained = shown.split("⟦", 1)[0], shown.split("⟦", 1)[1].rstrip("⟧")
    if case.template is None:  # qatune's own template
        assert prompt == f"Context: {row['context']}\nQuestion: {row['question']}\nAnswer:"
        assert trained == f" {row['answer']}{case.eos}"
        return
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    user = {"role": "user", "content": f"{row['context']}\n\nQuestion: {row['question']}"}
    # The prompt is the family's own chat rendering (with what its template writes before every answer: Qwen3's empty
    # thinking block), and the trained tokens the answer up to the end of turn.
    generation = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    assert prompt.startswith(generation) and prompt[len(generation):] in ("", "<think>\n\n</think>\n\n")
    full = tokenizer.apply_chat_template([user, {"role": "assistant", "content": row["answer"]}], tokenize=False)
    assert full.startswith(prompt + trained) and trained == row["answer"] + case.end_of_turn


@pytest.mark.slow
def test_check_says_before_training_when_the_model_cannot_be_exported(tmp_path):
    """A Gemma 3 whose queries are scaled otherwise than llama.cpp scales Gemma's: check warns (gguf) naming why, and
    export refuses the same way (tests/unit/model/test_families.py)."""
    case = next(c for c in CASES if c.id == "gemma3")
    folder, config, _ = family_setup(case, tmp_path, ROWS)
    settings = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**settings, "query_pre_attn_scalar": 64}))
    report = json.loads(cli_ok("check", "--config", config, "--json").stdout)
    said = [f["message"] for f in report["findings"] if f["code"] == "gguf"]
    assert len(said) == 1 and "qatune writes a Gemma 3 model as GGUF only if its query_pre_attn_scalar equals its " \
        "head_dim" in said[0] and "--merge FOLDER" in said[0]


@pytest.mark.slow
def test_full_training_learns_the_rows(family):
    _, _, _, run, _ = family
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert losses[-1] < losses[0] / 5
    assert (run / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_generate_answers_the_learned_rows(family, tmp_path):
    _, _, _, run, data = family
    written = cli_ok("generate", run, "--file", data, "--output", tmp_path / "answers.csv", "--grounded", "off")
    with open(written.stdout.strip(), encoding="utf-8", newline="") as f:
        answered = [(row["answer"], gold["answer"]) for row, gold in zip(csv.DictReader(f), sheet_rows(ROWS))]
    assert sum(got == gold for got, gold in answered) > ROWS // 4, answered  # an untrained model: none


@pytest.mark.slow
def test_generate_held_to_a_new_passage_answers_with_a_span_of_it(family):
    _, _, _, run, _ = family
    passage = "The council met in Brussels in 1999 and again in 2004."
    question = sheet_rows(2)[1]["question"]
    grounded = cli_ok("generate", run, question, "--context", passage, "--grounded", "on").stdout.strip()
    assert grounded and grounded[1:] in passage and grounded[0].lower() in passage.lower()


@pytest.mark.slow
def test_eval_scores_the_learned_rows(family):
    _, _, _, run, data = family
    metrics = json.loads(cli_ok("eval", run, "--data", data, "--json").stdout)
    assert metrics["num_examples"] == ROWS and metrics["exact_match"] >= 50


@pytest.mark.slow
def test_lora_trains_adapters_on_the_targets_of_the_family_record(family, tmp_path):
    pytest.importorskip("peft")
    _, folder, config, _, _ = family
    run = Path(cli_ok("train", "--config", config, "--output-dir", tmp_path / "lora", "--quiet", "--set",
                      "model.lora.r=8", "--set", "train.epochs=4").stdout.strip().splitlines()[-1])
    from safetensors.torch import load_file
    from transformers import AutoConfig

    record = family_of(AutoConfig.from_pretrained(folder))
    adapter = json.loads((run / "final" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == sorted(record.lora_targets)
    layers = AutoConfig.from_pretrained(folder).get_text_config().num_hidden_layers
    adapted = [key for key in load_file(run / "final" / "adapter_model.safetensors") if "lora_A" in key]
    assert len(adapted) == layers * len(record.lora_targets)


@pytest.mark.slow
def test_serve_answers_as_generate_does_at_temperature_0(family):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from qatune.inference.generate import answer_questions
    from qatune.model.folder import load_model_folder
    from qatune.serve.app import Settings, create_app

    _, _, _, run, _ = family
    rows = sheet_rows(3)
    loaded = load_model_folder(run, device="cpu")
    expected = answer_questions(loaded.model, loaded.tokenizer, loaded.info, [r["question"] for r in rows],
                                [r["context"] for r in rows], loaded.config.generate)
    with TestClient(create_app(loaded, Settings(max_batch_size=4)), base_url=LOCAL) as client:
        answers = []
        for row in rows:
            response = client.post("/v1/answer", json={"question": row["question"], "context": row["context"]})
            assert response.status_code == 200, response.text
            answers.append(response.json()["answer"])
    assert answers == expected


BROKEN = {"smollm2": {"permuted": ()}, "gemma3": {"norm_shift": 0.0},
          "qwen3": {"hyperparameters": (("rope.freq_base", lambda config: 1.0),)}}
"""Records written wrong, per case: queries and keys not permuted for llama.cpp's rope, Gemma's norms not shifted, a
wrong rope base (besides the record's own keys). Export's check reads these families back with transformers' reader;
a family it reads back through its own layout (SmolLM3, Llama 3's rope factors) is held to llama.cpp's converter by
tests/unit/export/test_gguf_families.py instead."""


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_export_gguf_writes_the_family_or_refuses_it_in_one_line(family, quant, tmp_path, monkeypatch):
    """Written as the family's record says, read back and asked the run's rows by export's own check (the same
    prompts, id for id, and the next tokens of the run's weights rounded to the file's precision), the end of a turn
    ending generation in the file; or refused in one line naming the family. Written by a broken record (BROKEN),
    the file is refused by that check and not left."""
    gguf = pytest.importorskip("gguf")
    from click.testing import CliRunner
    from transformers import AutoConfig, AutoTokenizer

    from qatune.cli import cli

    case, folder, _, run, _ = family
    record = family_of(AutoConfig.from_pretrained(folder))
    path = tmp_path / f"tiny-{quant}.gguf"
    result = CliRunner().invoke(cli, ["export", str(run), "--gguf", str(path), "--quant", quant])
    if record.gguf_written:
        assert result.exit_code == 0, result.output + result.stderr
        assert path.is_file() and path.with_suffix(".Modelfile").is_file()
        check = json.loads((run / f"export-tiny-{quant}.json").read_text())
        assert check["passed"] and check["prompts_identical"] == check["rows"] == ROWS
        assert check["next_tokens_as_rounded"] == check["positions"]
        fields = gguf.GGUFReader(str(path)).fields
        assert fields["general.architecture"].contents() == record.gguf_architecture
        stops = {fields[key].contents() for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                 if key in fields}
        assert AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(case.end_of_turn) in stops
        if quant == "f16" and case.id in BROKEN:
            import dataclasses

            from qatune.model import families

            changes = dict(BROKEN[case.id])
            if "hyperparameters" in changes:
                changes["hyperparameters"] = (*record.gguf.hyperparameters, *changes["hyperparameters"])
            index = families.FAMILIES.index(record)
            broken = dataclasses.replace(record, gguf=dataclasses.replace(record.gguf, **changes))
            monkeypatch.setattr(families, "FAMILIES", (*families.FAMILIES[:index], broken,
                                                       *families.FAMILIES[index + 1:]))
            wrong = CliRunner().invoke(cli, ["export", str(run), "--gguf", str(tmp_path / "broken.gguf")])
            assert wrong.exit_code == 1 and "does not answer as the run does" in wrong.stderr, wrong.stderr
            assert not (tmp_path / "broken.gguf").exists()
    else:
        assert result.exit_code == 1 and not path.exists()
        assert len(result.stderr.strip().splitlines()) == 1
        assert f"qatune does not write {record.name} models" in result.stderr
