"""Bad input through the CLI: every case exits non-zero with one clear line, no traceback, and leaves no
run directory that looks complete."""

import json

import pytest
import torch
from click.testing import CliRunner
from openpyxl import Workbook

from qatune.cli import cli

GOOD_ROWS = "".join(f"what is item {i}?,thing {i}\n" for i in range(12))
SCRATCH = "model: {scratch: {n_layer: 1, n_embd: 32, n_head: 2, vocab_size: 300}}\n"


def config(tmp, data, extra="", model=SCRATCH, task="generative", train="epochs: 1, batch_size: 4"):
    path = tmp / "config.yaml"
    path.write_text(f"task: {task}\n{model}data:\n  train_file: {data}\n{extra}train: {{{train}}}\n",
                    encoding="utf-8")
    return path


def csv_file(tmp, content, name="data.csv", mode="text"):
    path = tmp / name
    if mode == "bytes":
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def xlsx(tmp, name="data.xlsx", sheet="Sheet1"):
    book = Workbook()
    book.active.title = sheet
    book.active.append(["question", "answer"])
    book.active.append(["q?", "a"])
    book.save(tmp / name)
    return tmp / name


def scratch_folder(tmp, weights=True, slow_tokenizer=False):
    """A local model folder: a tiny BERT QA model, optionally without weights or with a slow tokenizer."""
    from transformers import BertConfig, BertForQuestionAnswering

    folder = tmp / "model"
    model = BertForQuestionAnswering(BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=64))
    model.save_pretrained(folder)
    if not weights:
        (folder / "model.safetensors").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer"}))
    return folder


# Each case: (id, builder(tmp) -> CLI args, expected text in the error line)
def train_with(build_data, extra="", **kw):
    def build(tmp):
        return ["train", "--config", str(config(tmp, build_data(tmp), extra, **kw)), "--output-dir",
                str(tmp / "run")]
    return build


CONTEXT = "  context_column: context\n"
CASES = [
    ("missing file", train_with(lambda t: t / "nope.csv"), "data file {tmp}/nope.csv not found"),
    ("directory instead of file", train_with(lambda t: t), "is a directory; give the spreadsheet file"),
    ("empty file", train_with(lambda t: csv_file(t, "")), "is empty; it needs a header row"),
    ("header only", train_with(lambda t: csv_file(t, "question,answer\n")), "has a header but no data rows"),
    ("binary garbage", train_with(lambda t: csv_file(t, b"\x00\x9f\xff" * 500, mode="bytes")), "binary data"),
    ("ragged rows", train_with(lambda t: csv_file(t, "question,answer\nq,a\nq,a,b,c\n")),
     "line 3 has 4 cells but the header has 2"),
    ("wrong delimiter", train_with(lambda t: csv_file(t, "question;answer\nq;a\n")),
     "the header looks ';'-separated, set data.delimiter"),
    ("non-UTF-8 bytes", train_with(lambda t: csv_file(t, "question,answer\ncafé?,oui\n".encode("cp1252"),
                                                         mode="bytes")), "set data.encoding"),
    ("UTF-16 file", train_with(lambda t: csv_file(t, "question,answer\nq,a\n".encode("utf-16"), mode="bytes")),
     "UTF-16 text; set data.encoding: utf-16"),
    ("xlsx wrong sheet", train_with(lambda t: xlsx(t), extra="  sheet: Answers\n"),
     "has no sheet named 'Answers'; its sheets are ['Sheet1']; set data.sheet"),
    ("csv renamed to xlsx", train_with(lambda t: csv_file(t, "question,answer\nq,a\n", name="data.xlsx")),
     "is not an Excel workbook (it looks like plain text); rename it to .csv"),
    ("old xls", train_with(lambda t: csv_file(t, "x", name="data.xls")), "save it as .xlsx"),
    ("missing column", train_with(lambda t: csv_file(t, "question,reply\nq,a\n")),
     "column 'answer' not found in data.csv; columns are ['question', 'reply']; set data.answer_column"),
    ("duplicate column names", train_with(lambda t: csv_file(t, "question,answer,answer\nq,a,b\n")),
     "column 'answer' is ambiguous in data.csv"),
    ("all answers empty", train_with(lambda t: csv_file(t, "question,answer\nq1,\nq2,  \n")),
     "has no usable rows: data.csv: 2 rows read, 0 kept, 2 dropped (blank answer: rows 2, 3)"),
    ("1 MB cells", train_with(lambda t: csv_file(t, "question,answer\nq," + "x" * 1_000_000 + "\n")),
     "answer longer than 100000 characters (data.max_cell_chars)"),
    ("NaN and inf numbers", train_with(lambda t: csv_file(
        t, '{"question": "q1", "answer": NaN}\n{"question": "q2", "answer": Infinity}\n', name="d.jsonl")),
     "has no usable rows"),
    ("answer not in context", train_with(lambda t: csv_file(
        t, "question,context,answer\nwho?,Ada wrote it.,Bob\nwhen?,In 1843.,1999\n"), extra=CONTEXT,
        task="extractive"), "the answer is not in the context (rows 2, 3)"),
    ("context column missing", train_with(lambda t: csv_file(t, "question,answer\nq,a\n"), extra=CONTEXT,
                                          task="extractive"), "column 'context' not found"),
    ("extractive without context_column", train_with(lambda t: csv_file(t, "question,answer\nq,a\n"),
                                                     task="extractive"), "data.context_column: required"),
    ("answers longer than max_length", train_with(
        lambda t: csv_file(t, "question,answer\nq," + "word " * 40 + "\n"), extra="  max_length: 8\n"),
     "does not fit max_length=8"),
    ("fp16 on CPU", train_with(lambda t: csv_file(t, "question,answer\n" + GOOD_ROWS),
                               train="epochs: 1, device: cpu, precision: fp16"),
     "train.precision fp16 needs a GPU; on CPU use bf16 or fp32"),
    *([("cuda without a GPU", train_with(lambda t: csv_file(t, "question,answer\n" + GOOD_ROWS),
                                         train="epochs: 1, device: cuda"),
        "train.device is cuda but no GPU is visible")] if not torch.cuda.is_available() else []),
    ("model path does not exist", train_with(lambda t: csv_file(t, "question,answer\n" + GOOD_ROWS),
                                             model="model: {name_or_path: ./no/such/model}\n"),
     "model folder './no/such/model' not found; check model.name_or_path"),
]


def yaml_case(text, expected):
    def build(tmp):
        path = tmp / "config.yaml"
        path.write_text(text, encoding="utf-8")
        return ["train", "--config", str(path), "--output-dir", str(tmp / "run")]
    return build, expected


CONFIG_CASES = [
    ("yaml syntax error", *yaml_case("train: [epochs: 1\n", "is not valid YAML at line 2")),
    ("yaml list", *yaml_case("- train\n- data\n", "holds a YAML list, not a mapping")),
    ("unknown key", *yaml_case(SCRATCH + "data: {train_file: x.csv}\ntrain: {epoch: 3}\n",
                               "train.epoch: unknown key; did you mean 'train.epochs'?")),
    ("wrong type", *yaml_case(SCRATCH + "data: {train_file: x.csv}\ntrain: {epochs: many}\n",
                              "train.epochs: must be a valid integer")),
    ("negative learning rate", *yaml_case(SCRATCH + "data: {train_file: x.csv}\ntrain: {learning_rate: -0.1}\n",
                                          "train.learning_rate: must be greater than 0 (got -0.1)")),
    ("zero batch size", *yaml_case(SCRATCH + "data: {train_file: x.csv}\ntrain: {batch_size: 0}\n",
                                   "train.batch_size: must be greater than or equal to 1 (got 0)")),
]


def run_case(tmp, args):
    result = CliRunner().invoke(cli, args)
    return result


def assert_clean_failure(result, expected, tmp):
    assert result.exit_code not in (0, None), result.output
    assert "Traceback" not in result.output and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr
    assert expected.format(tmp=tmp) in last, last
    run = tmp / "run"
    assert not (run / "final").exists()
    assert not run.exists() or json.loads((run / "run.json").read_text()).get("status") != "complete"


@pytest.mark.parametrize("name, build, expected", CASES + CONFIG_CASES, ids=[c[0] for c in CASES + CONFIG_CASES])
def test_train_refuses_bad_input(tmp_path, name, build, expected):
    result = run_case(tmp_path, build(tmp_path))
    assert_clean_failure(result, expected, tmp_path)
    assert not (tmp_path / "run").exists()          # nothing was written


def test_model_folder_without_weights(tmp_path):
    folder = scratch_folder(tmp_path, weights=False)
    (folder / "tokenizer_config.json").unlink()
    from tests.conftest import wordpiece_tokenizer

    wordpiece_tokenizer(["q", "a"]).save_pretrained(folder)
    data = csv_file(tmp_path, "question,context,answer\nq,q a,a\n")
    args = ["train", "--config", str(config(tmp_path, data, CONTEXT, model=f"model: {{name_or_path: {folder}}}\n",
                                            task="extractive"))]
    assert_clean_failure(run_case(tmp_path, args), "has no model.safetensors; qatune loads safetensors only", tmp_path)


def test_tokenizer_without_a_fast_version_for_extractive(tmp_path):
    folder = scratch_folder(tmp_path)
    data = csv_file(tmp_path, "question,context,answer\nq,q a,a\n")
    args = ["train", "--config", str(config(tmp_path, data, CONTEXT, model=f"model: {{name_or_path: {folder}}}\n",
                                            task="extractive"))]
    assert_clean_failure(run_case(tmp_path, args), "extractive QA needs a fast tokenizer", tmp_path)


def test_output_dir_is_a_file(tmp_path):
    (tmp_path / "run").write_text("not a folder")
    data = csv_file(tmp_path, "question,answer\n" + GOOD_ROWS)
    result = run_case(tmp_path, ["train", "--config", str(config(tmp_path, data)),
                                 "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 1
    assert f"output_dir {tmp_path}/run is a file" in result.stderr.strip().splitlines()[-1]
    assert (tmp_path / "run").read_text() == "not a folder"


def test_output_dir_not_writable(tmp_path):
    data = csv_file(tmp_path, "question,answer\n" + GOOD_ROWS)
    result = run_case(tmp_path, ["train", "--config", str(config(tmp_path, data)), "--output-dir",
                                 "/proc/qatune-run"])
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "/proc/qatune-run" in result.stderr.strip().splitlines()[-1]


def test_existing_run_directory_is_refused(tmp_path):
    data = csv_file(tmp_path, "question,answer\n" + GOOD_ROWS)
    args = ["train", "--config", str(config(tmp_path, data)), "--output-dir", str(tmp_path / "run"), "--quiet"]
    assert run_case(tmp_path, args).exit_code == 0
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    result = run_case(tmp_path, args)
    assert result.exit_code == 1
    assert "already holds a run; pass --overwrite to replace it" in result.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_a_folder_of_other_files_is_refused_without_suggesting_overwrite(tmp_path, overwrite):
    data = csv_file(tmp_path, "question,answer\n" + GOOD_ROWS)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.csv").write_text("keep me")
    result = run_case(tmp_path, ["train", "--config", str(config(tmp_path, data)), "--output-dir", str(mine),
                                 "--quiet", *overwrite])
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"error: output_dir {mine} holds files and is not a qatune run; qatune will not delete it "
                    "(not even with --overwrite); choose another --output-dir")
    assert sorted(p.name for p in mine.iterdir()) == ["notes.csv"]


def test_eval_on_a_folder_that_is_not_a_run(tmp_path):
    data = csv_file(tmp_path, "question,answer\nq,a\n")
    result = run_case(tmp_path, ["eval", str(tmp_path), "--data", str(data)])
    assert result.exit_code == 1
    assert "is not a qatune run directory" in result.stderr


def test_generate_with_an_empty_question(tmp_path):
    result = run_case(tmp_path, ["generate", str(tmp_path), "   "])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: the question is empty")


def test_config_file_missing_and_bad_set(tmp_path):
    result = run_case(tmp_path, ["train", "--config", str(tmp_path / "none.yaml")])
    assert result.exit_code == 1 and "config file" in result.stderr and "not found" in result.stderr
    data = csv_file(tmp_path, "question,answer\n" + GOOD_ROWS)
    result = run_case(tmp_path, ["train", "--config", str(config(tmp_path, data)), "--set", "train.epochs"])
    assert result.exit_code == 1 and "expected KEY=VALUE" in result.stderr


def test_verbose_shows_the_traceback(tmp_path):
    result = run_case(tmp_path, ["-v", "train", "--config", str(config(tmp_path, tmp_path / "none.csv"))])
    assert result.exit_code == 1 and "Traceback" in result.stderr


@pytest.mark.parametrize("name, build, expected", CASES + CONFIG_CASES, ids=[c[0] for c in CASES + CONFIG_CASES])
def test_check_refuses_bad_input_with_the_line_train_gives(tmp_path, name, build, expected):
    train_args = build(tmp_path)
    check_args = ["check", *train_args[1:train_args.index("--output-dir")]]
    result = run_case(tmp_path, check_args)
    assert_clean_failure(result, expected, tmp_path)
    assert not (tmp_path / "run").exists()
    trained = run_case(tmp_path, train_args)
    assert result.stderr.strip().splitlines()[-1] == trained.stderr.strip().splitlines()[-1]
