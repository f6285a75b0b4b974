"""Loading a config: defaults < YAML < --set, every problem at once, each naming its key; every shipped config
loads; YAML is read safely."""

import pytest

from qatune.config import Config, field_names, load_config
from qatune.errors import ConfigError
from tests.conftest import ROOT


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    return path


BASE = "model:\n  name_or_path: gpt2\ndata:\n  train_file: faq.csv\n"


def test_contract_keys_load_with_their_types(tmp_path):
    config = load_config(write(tmp_path, """
task: generative
seed: 7
output_dir: runs/x
model:
  name_or_path: gpt2
data:
  train_file: examples/data/faq.csv
  eval_file: null
  question_column: q
  answer_column: a
  context_column: null
  sheet: 2
train:
  epochs: 3
  batch_size: 8
  learning_rate: 5e-5
  max_grad_norm: 1.0
"""))
    assert config.seed == 7 and config.data.sheet == 2 and config.data.question_column == "q"
    # YAML 1.1 reads 5e-5 as a string; it must still become the float the user meant.
    assert config.train.learning_rate == pytest.approx(5e-5)
    assert {"task", "seed", "output_dir", "model.name_or_path", "data.train_file", "data.eval_file",
            "data.question_column", "data.answer_column", "data.context_column", "data.sheet", "train.epochs",
            "train.batch_size", "train.learning_rate", "train.max_grad_norm"} <= set(field_names())


def test_unknown_key_suggests_the_closest(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, BASE + "train:\n  lerning_rate: 0.1\n"))
    assert str(err.value).endswith("train.lerning_rate: unknown key; did you mean 'train.learning_rate'?")


def test_all_problems_are_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, BASE + "train:\n  batch_size: 0\n  learning_rate: -1\n  epochs: many\n"
                                           "data2: {}\n" + "  \n"))
    text = str(err.value)
    assert "has 4 problems" in text
    for expected in ["train.batch_size: must be greater than or equal to 1 (got 0)",
                     "train.learning_rate: must be greater than 0 (got -1)",
                     "train.epochs: must be a valid integer",
                     "data2: unknown key; did you mean 'data'?"]:
        assert expected in text


@pytest.mark.parametrize("text, message", [
    ("data:\n  train_file: x\n  max_length: 4\n" + "model: {name_or_path: gpt2}\n",
     "data.max_length: must be at least 8"),
    ("model: {scratch: {n_embd: 100, n_head: 3}}\ndata: {train_file: x}\n", "not divisible by n_head=3"),
    ("task: extractive\nmodel: {name_or_path: bert}\ndata: {train_file: x}\n", "data.context_column: required"),
    ("model: {name_or_path: g}\ndata: {train_file: x, prompt_template: 'Q: no column'}\n", "names no column"),
    ("model: {name_or_path: g}\ndata: {train_file: x, prompt_template: 'Q: {question'}\n", "unbalanced braces"),
    ("model: {name_or_path: g}\ndata: {train_file: x, prompt_template: '{Context} {question}'}\n",
     "uses {context} but data.context_column is not set"),
    ("model: {name_or_path: g}\ndata: {train_file: x, prompt_template: 'Q: {question}', system_prompt: hi}\n",
     "data.system_prompt: only used with a chat template"),
    ("model: {name_or_path: g}\ndata: {train_file: x, prompt_template: chat, user_template: 'plain'}\n",
     "data.user_template: names no column"),
    ("data: {train_file: x}\n", "set model.name_or_path"),
    ("model: {scratch: {n_layer: 1}, dropout: 0.0}\ndata: {train_file: x}\n",
     "model.dropout: a scratch model's dropout is model.scratch.dropout"),
    ("model: {name_or_path: g, dropout: 1.0}\ndata: {train_file: x}\n", "model.dropout: must be less than 1"),
    ("model: {name_or_path: g, number_head: values}\ndata: {train_file: x}\n",
     r"model.number_head: only for task scoring \(how its number heads predict\); remove it"),
    ("task: extractive\nmodel: {name_or_path: g}\ndata: {train_file: x, context_column: c, class_weights: sqrt}\n",
     r"data.class_weights: only for task scoring \(how its label heads weigh their classes\); remove it"),
    ("task: scoring\nmodel: {name_or_path: g, number_head: median}\ndata: {train_file: x, answer_columns: [a]}\n",
     "model.number_head: must be 'regression' or 'values'"),
    ("task: summarise\n", "task: must be 'generative', 'extractive', 'scoring' or 'multiple-choice'"),
    ("seed: true\nmodel: {name_or_path: g}\ndata: {train_file: x}\n", "seed: must be a number, not true"),
    ("model: {name_or_path: g}\ndata: {train_file: x}\ntrain: {max_grad_norm: false}\n",
     "train.max_grad_norm: must be a number, not false"),
])
def test_invalid_values(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_set_overrides_with_type_checking(tmp_path):
    path = write(tmp_path, BASE)
    config = load_config(path, ["train.learning_rate=1e-5", "train.epochs=2", "data.sheet=Marks",
                                "model.trust_remote_code=true"])
    assert (config.train.learning_rate, config.train.epochs, config.data.sheet) == (1e-5, 2, "Marks")
    assert config.model.trust_remote_code is True
    with pytest.raises(ConfigError, match=r": --set train\.epochs: must be a valid integer"):
        load_config(path, ["train.epochs=lots"])
    with pytest.raises(ConfigError, match=r": --set train\.bach_size: unknown key; did you mean 'train\.batch_size'"):
        load_config(path, ["train.bach_size=4"])
    with pytest.raises(ConfigError, match=r": --set foo: unknown key"):
        load_config(path, ["foo.bar=1"])
    with pytest.raises(ConfigError, match=r": --set data: is a section: set its keys \(data\.KEY: VALUE\), not a "
                                          r"value \(got 3\)$"):
        load_config(path, ["data=3"])
    (tmp_path / "typo.yaml").write_text(BASE + "seed: yes\n")  # in the file, not on the command line
    with pytest.raises(ConfigError, match=r"typo\.yaml: seed: must be a number"):
        load_config(tmp_path / "typo.yaml", ["train.epochs=2"])
    assert load_config(path, ["data.delimiter=tab"]).data.delimiter == "\t"
    assert load_config(path, [r"data.delimiter=\t"]).data.delimiter == "\t"
    with pytest.raises(ConfigError, match=r"--set data\.delimiter: must be one character, or tab \(got ';;'\)"):
        load_config(path, ["data.delimiter=;;"])
    # A column named by a number (YAML reads 2024 as one) is the column's name.
    assert load_config(path, ["data.question_column=2024"]).data.question_column == "2024"
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(path, ["train.epochs"])


@pytest.mark.parametrize("given, key, expected", [
    # Characters YAML would read as a block scalar, a comment, a tag or a mapping stay what was typed.
    ("data.answer_separator=|", "answer_separator", "|"),
    ("data.answer_separator=>", "answer_separator", ">"),
    ("data.answer_separator=#", "answer_separator", "#"),
    ("data.answer_separator=!", "answer_separator", "!"),
    ("data.delimiter=|", "delimiter", "|"),
    ("data.prompt_template=Q: {question}", "prompt_template", "Q: {question}"),
    ("data.user_template={question}", "user_template", "{question}"),
    # A template's \n typed in a shell is a line break, as in a YAML "..." string.
    (r"data.prompt_template=Marks: {Total Marks}\nQ: {question}\nA:", "prompt_template",
     "Marks: {Total Marks}\nQ: {question}\nA:"),
    ('data.prompt_template="Q:\\n{question}"', "prompt_template", "Q:\n{question}"),
    # Quoted, null and typed values keep YAML's reading.
    ("data.answer_separator='|'", "answer_separator", "|"),
    ('data.system_prompt=""', "system_prompt", ""),
    ("data.system_prompt=null", "system_prompt", None),
    ("data.sheet=0", "sheet", 0),
    ("data.sheet=Marks", "sheet", "Marks"),
])
def test_set_keeps_text_as_typed_for_keys_that_take_text(tmp_path, given, key, expected):
    config = load_config(write(tmp_path, BASE), [given])
    assert getattr(config.data, key) == expected


def test_set_still_reads_numbers_lists_and_sections(tmp_path):
    config = load_config(write(tmp_path, BASE), ["train.batch_size=8", "train.group_by_length=false",
                                                 "model.lora.target_modules=[q_proj, v_proj]", "model.lora.r=4"])
    assert (config.train.batch_size, config.train.group_by_length) == (8, False)
    assert config.model.lora.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize("text, message", [
    ("model: [\n", "not valid YAML at line 2"),
    ("- a\n- b\n", "holds a YAML list, not a mapping"),
    ("", "is empty"),
])
def test_bad_yaml_files(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "none.yaml")


def test_resolved_config_round_trips(tmp_path):
    config = load_config(write(tmp_path, BASE), ["train.scheduler.gamma=0.5"])
    again = load_config(write(tmp_path, config.to_yaml()))
    assert again == config


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    config = load_config(path)
    assert isinstance(config, Config)
    assert (ROOT / config.data.train_file).exists()
    if config.data.eval_file:
        assert (ROOT / config.data.eval_file).exists()


def test_yaml_is_read_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    marker = tmp_path / "pwned"
    path.write_text(f'!!python/object/apply:os.system ["touch {marker}"]\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    assert not marker.exists()
