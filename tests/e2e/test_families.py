"""Each model family qatune knows (qatune.model.families) through the commands, as a user with a local folder of that
family runs them: a tiny random model built from the family's transformers config, with a tokenizer of its kind and
its own chat template (tests/families.py), checked (its memory estimate too), trained in full and with LoRA on the
targets its record names, sharded on two processes (train.distributed fsdp), asked freely, held to a passage and
graded (chosen fields), evaluated, served, and exported to GGUF where qatune writes the family. The check needs no
training and runs in the fast suite; the cells on a trained run are marked slow."""

import csv
import json
import math
import os
import signal
import subprocess
from pathlib import Path

import pytest

from qatune.commands.launch import torchrun_launcher
from qatune.model.families import family_of
from tests.conftest import LOCAL, ROOT, cli_ok
from tests.families import CASES, family_setup, sheet_rows, write_config, write_sheet

ROWS = 8


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every family's model folder, rows and config (tests/families.py's family_setup), built once:
    {case id: (case, model folder, config file, rows file)}."""
    return {case.id: (case, *family_setup(case, tmp_path_factory.mktemp(case.id), ROWS)) for case in CASES}


@pytest.fixture(scope="module", params=CASES, ids=[case.id for case in CASES])
def setup(request, built):
    """(case, model folder, config file, rows file) of one family."""
    return built[request.param.id]


@pytest.fixture(scope="module")
def checked(setup):
    """``qatune check --json``'s report of one family's config."""
    return json.loads(cli_ok("check", "--config", setup[2], "--json").stdout)


@pytest.fixture(scope="module")
def family(setup):
    """(case, model folder, config file, trained run, rows file) of one family: trained in full."""
    case, folder, config, data = setup
    run = Path(cli_ok("train", "--config", config, "--quiet").stdout.strip().splitlines()[-1])
    return case, folder, config, run, data


def test_check_trains_the_family_chat_prompt_and_its_end_of_turn(setup, checked):
    case, folder, _, _ = setup
    report = checked
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


PARTS = {"baseline", "weights", "gradients", "optimizer", "activations", "backward's working memory", "logits"}
"""What check's estimate of a process's peak adds up, in every set-up (FSDP's gathered units besides)."""


def test_memory_estimate_adds_up_its_parts_and_measures_the_family_block(setup, checked):
    """check's estimate of the peak per process, for one process, DDP and FSDP on two (FSDP's only where the model has
    blocks to shard: the family's decoder layers, found on the model built on the meta device), each the sum of its
    named parts; the activations measured on copies of the family's model with one and two blocks, not the formula
    that stands in for a model it cannot copy so."""
    from transformers import AutoModelForCausalLM

    from qatune.train.memory_estimate import measured_layer_bytes

    _, folder, _, _ = setup
    memory = checked["memory"]
    setups = {s["setup"]: s for s in memory["setups"]}
    assert list(setups) == ["1 process", "ddp x 2", "fsdp x 2"]
    for name, estimate in setups.items():
        parts = estimate["parts_gib"]
        assert PARTS <= set(parts) and ("gathered units" in parts) is (name == "fsdp x 2"), (name, parts)
        assert all(math.isfinite(v) and v >= 0 for v in parts.values()), (name, parts)
        assert math.isfinite(estimate["total_gib"]) and estimate["total_gib"] > 0
        assert abs(sum(parts.values()) - estimate["total_gib"]) <= 0.001 * len(parts), (name, estimate)
        assert parts["activations"] > 0 and parts["baseline"] > 0
    rows, width = memory["batch"]
    assert rows == ROWS
    model = AutoModelForCausalLM.from_pretrained(folder)
    per_token = measured_layer_bytes(model, width, "fp32", masters=False)
    assert per_token is not None and per_token > 0


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


def grading_rows(n: int) -> list[dict]:
    """The fixture sheet's rows graded: a label (one word or several) and a number (the answer's words)."""
    return [{"question": r["question"], "context": r["context"],
             "verdict": "one word" if len(r["answer"].split()) == 1 else "several words",
             "words": len(r["answer"].split())} for r in sheet_rows(n)]


def answer_log_likelihood(model, prompt: list[int], answer: list[int]) -> float:
    """log P(answer | prompt) from one forward pass over both, no cache."""
    import torch

    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + answer])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1: -1], -1)
    return float(logprobs.gather(1, torch.tensor(answer)[:, None]).sum())


@pytest.mark.slow
def test_chosen_fields_are_values_training_saw_and_the_most_likely_ones(setup, tmp_path):
    """A grading sheet's label and number fields (generate.choose_fields), chosen by scoring every value training saw
    after the prompt's keys and values, copied per candidate from the family's cache: every answer parses, each field
    is one of training's values, and the one the model's own forward without a cache finds most likely. One epoch:
    the choice is the mechanism's, not what training taught."""
    from qatune.data.generative import PromptEncoder
    from qatune.data.grading_fields import AnswerTemplate, format_value
    from qatune.data.templates import PromptTemplate
    from qatune.model.folder import load_model_folder

    _, folder, _, _ = setup
    rows = grading_rows(ROWS)
    sheet = write_sheet(tmp_path / "grades.csv", rows)
    config = write_config(tmp_path / "grading.yaml", folder, sheet, tmp_path / "grading", epochs=1, data={
        "answer_columns": ["verdict", "words"], "field_kinds": {"verdict": "label", "words": "number"}},
        generate={"precision": "fp32"})
    run = Path(cli_ok("train", "--config", config, "--quiet").stdout.strip().splitlines()[-1])
    graded = tmp_path / "graded.csv"
    cli_ok("generate", run, "--file", sheet, "--output", graded)
    with open(graded, encoding="utf-8", newline="") as f:
        answers = list(csv.DictReader(f))
    assert [a["parsed"] for a in answers] == ["yes"] * ROWS
    assert {a["verdict (model)"] for a in answers} <= {r["verdict"] for r in rows}
    assert {a["words (model)"] for a in answers} <= {format_value(r["words"]) for r in rows}
    loaded = load_model_folder(run, device="cpu")
    info, specs = loaded.info, loaded.info.specs()
    encoder = PromptEncoder(loaded.tokenizer, PromptTemplate(info.prompt_template, info.answer_prefix))
    literals, names = AnswerTemplate.make(list(info.answer_fields), info.answer_template).pieces()
    assert names == ["verdict", "words"] and all(specs[name].values for name in names)
    for row, answer in zip(rows, answers):
        prompt = encoder.prompt_ids(row["question"], row["context"])
        text = literals[0]
        for index, name in enumerate(names):
            last = index == len(names) - 1
            scores = {value: answer_log_likelihood(loaded.model, prompt, encoder.answer_ids(
                text + value + literals[index + 1])[: None if last else -1]) for value in specs[name].values}
            chosen = answer[f"{name} (model)"]
            assert scores[chosen] >= max(scores.values()) - 1e-4, (row["question"], name, chosen, scores)
            text += chosen + literals[index + 1]


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

    from qatune.kinds import answer_questions
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


STEPS = 3
"""Steps of each sharded run: batches of ROWS / 2 rows on each of two processes, every row in every step."""
SHARDED = """
import os, sys
from pathlib import Path
from click.testing import CliRunner
from qatune.cli import cli

rank = os.environ["RANK"]
os.environ.pop("TORCHELASTIC_ERROR_FILE", None)  # each process says its error in its own log, not the first only
for config in map(Path, sys.argv[3:]):
    try:  # this family's peak, not the highest of the families this process trained before it (VmHWM reset)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    if rank == "0":
        checked = CliRunner().invoke(cli, ["check", "--config", str(config), "--json"])
        (config.parent / "fsdp-check.json").write_text(checked.stdout)
    done = CliRunner().invoke(cli, ["train", "--config", str(config), "--output-dir", str(config.parent / "fsdp"),
                                    "--quiet", "--set", "train.distributed=fsdp", "--set", "model.dropout=0.0",
                                    "--set", f"train.epochs={sys.argv[1]}", "--set", f"train.batch_size={sys.argv[2]}"])
    (config.parent / f"fsdp-{rank}.log").write_text(f"exit {done.exit_code}\\n{done.stderr}")
"""


@pytest.fixture(scope="module")
def sharded(built, tmp_path_factory):
    """Every family trained STEPS steps with train.distributed fsdp on two CPU processes (gloo), in one torchrun job
    whose two processes run ``qatune train`` for each family in turn (torch and transformers started once, not once
    per family), after ``qatune check --json`` on the first: {case id: (the run's folder, each process's log, check's
    report)}."""
    tmp = tmp_path_factory.mktemp("sharded")
    (tmp / "sharded.py").write_text(SHARDED)
    configs = [str(config) for _, _, config, _ in built.values()]
    job = subprocess.Popen([*torchrun_launcher(2), str(tmp / "sharded.py"), str(STEPS), str(ROWS // 2),
                            *configs], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        output = job.communicate(timeout=300)[0]
        said = f"torchrun ended with {job.returncode}: {output[-3000:]}"
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)  # torchrun and its two processes
        said = f"torchrun did not end within 300 s: {job.communicate()[0][-3000:]}"
    results = {}
    for case_id, (_, _, config, _) in built.items():
        logs = [config.parent / f"fsdp-{rank}.log" for rank in (0, 1)]
        report = config.parent / "fsdp-check.json"
        results[case_id] = (config.parent / "fsdp", [log.read_text() if log.is_file() else said for log in logs],
                            json.loads(report.read_text()) if report.is_file() else None)
    return results


def train_events(run: Path) -> list[dict]:
    return [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if m["event"] == "train"]


def drops_out(folder: Path) -> bool:
    """Whether the family's model uses dropout while training (GPT-2's 0.1)."""
    from transformers import AutoConfig

    return any(isinstance(v, float) and v > 0 for k, v in AutoConfig.from_pretrained(folder).to_dict().items()
               if "drop" in k)


def rope_by_width(folder: Path) -> bool:
    """Whether the model's rope depends on its batch's width (longrope: transformers takes the long factors for a
    batch wider than the original context, so a row's loss depends on the rows padded beside it)."""
    from transformers import AutoConfig

    settings = AutoConfig.from_pretrained(folder)
    rope = getattr(settings, "rope_parameters", None) or getattr(settings, "rope_scaling", None) or {}
    return rope.get("rope_type") == "longrope"


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_shards_the_family_decoder_layers_and_trains_as_one_process(family, sharded, tmp_path):
    """Each decoder layer of the family's record is an FSDP unit, and the sharded steps are one process's: the full
    training's first STEPS (the same ROWS rows in one batch each step), or, for a model that drops out (each process
    draws its own masks), a one-process run of the same steps without dropout; for a model whose rope depends on the
    batch's width, a one-process run of the same steps accumulating the two processes' batches."""
    from transformers import AutoConfig

    case, folder, config, run, _ = family
    two, logs, _ = sharded[case.id]
    assert all(log.startswith("exit 0\n") for log in logs), logs
    log = logs[0]
    settings = AutoConfig.from_pretrained(folder)
    layers = settings.get_text_config().num_hidden_layers
    assert f"fsdp: {layers} FSDP{family_of(settings).decoder_layer} units and the root, sharded on 2 processes" in log
    if drops_out(folder) or rope_by_width(folder):
        batches = (["--set", f"train.batch_size={ROWS // 2}", "--set", "train.gradient_accumulation_steps=2"]
                   if rope_by_width(folder) else [])
        run = Path(cli_ok("train", "--config", config, "--output-dir", tmp_path / "one", "--quiet", "--set",
                          f"train.epochs={STEPS}", "--set", "model.dropout=0.0",
                          *batches).stdout.strip().splitlines()[-1])
    one, sharded_steps = train_events(run)[:STEPS], train_events(two)
    assert [m["step"] for m in sharded_steps] == [m["step"] for m in one] == list(range(1, STEPS + 1))
    for a, b in zip(one, sharded_steps):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * a["grad_norm"], (a, b)


@pytest.mark.slow
@pytest.mark.distributed
def test_memory_estimate_is_near_the_peak_of_the_sharded_run(setup, sharded):
    """check's estimate of a process's peak under FSDP on two processes (made in the first of them, just before it
    trained), against the peak the sharded run measured in its largest process: within the bounds of
    tests/e2e/test_fsdp.py."""
    two, logs, report = sharded[setup[0].id]
    assert report is not None and (two / "run.json").is_file(), logs
    estimated = {s["setup"]: s["total_gib"] for s in report["memory"]["setups"]}["fsdp x 2"]
    measured = json.loads((two / "run.json").read_text())["result"]["peak_memory_mb"] / 1024
    assert 0.7 * measured <= estimated <= 1.3 * measured, (estimated, measured)


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
