"""The dependency pins of pyproject.toml stay true: every floor is at least what qatune's code calls (NEEDED, each
with the call that sets it), every installed package meets its pins, and gguf at its floor, installed into a
scratch environment, writes and reads a GGUF file as qatune does (slow: pip fetches it from PyPI)."""

import json
import os
import site
import subprocess
import venv
from importlib.metadata import PackageNotFoundError, version

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import ROOT

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

NEEDED = {
    "torch": ("2.6", "torch.distributed.fsdp exports fully_shard, MixedPrecisionPolicy, OffloadPolicy and "
                     "CPUOffloadPolicy (train/sharding.py); transformers 5 requires it too"),
    "transformers": ("5.18", "GgufConfig (5.17: model/sources.py loads a GGUF file dequantized) and the packaged "
                             "SmolLM2 file's EOS read as <|im_end|>, not <|im_start|> (5.18)"),
    "pydantic": ("2.7", "ConfigDict(use_attribute_docstrings=True) (config/sections.py: every key's documentation)"),
    "gguf": ("0.16", "ReaderField.contents() (model/gguf_file.py: reading a file's metadata)"),
    "peft": ("0.18", "imports beside transformers 5 (0.17 imports its removed HybridCache); LoRA layers with "
                     "lora_variant and lora_bias (0.16, speedups/fused_lora.py)"),
    "accelerate": ("1.9", "transformers loads a GGUF file only beside accelerate 1.1+; a tracker's start() (1.8, "
                          "train/logs.py); DataLoaderShard resuming mid-epoch (1.9; 1.8 raises UnboundLocalError)"),
    "click": ("8.1", "the command line; the tests read CliRunner's stderr apart, which needs 8.2"),
}
"""The least version of each package whose calls qatune makes, and the call that sets it."""

EXTRA_NEEDED = {("trackio", "accelerate"): "1.14", ("test", "click"): "8.2"}
"""Floors an extra needs above the package's own: accelerate's TrackioTracker logging each step as given (1.14),
CliRunner's separate stderr (8.2)."""


def requirements() -> list[tuple[str, Requirement]]:
    """(where, requirement) of every pin: the dependencies, then each extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    pins = [("dependencies", Requirement(text)) for text in project["dependencies"]]
    for extra, listed in project["optional-dependencies"].items():
        pins += [(extra, Requirement(text)) for text in listed]
    return pins


def floor(requirement: Requirement) -> Version | None:
    floors = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "~=", "==")]
    return max(floors) if floors else None


def test_every_pin_has_a_floor_at_least_what_the_code_calls():
    pins = requirements()
    assert [f"{r} ({where})" for where, r in pins if floor(r) is None] == []
    too_low = []
    for where, requirement in pins:
        name = canonicalize_name(requirement.name)
        needed = EXTRA_NEEDED.get((where, name)) or (NEEDED[name][0] if name in NEEDED else None)
        if needed is not None and floor(requirement) < Version(needed):
            too_low.append(f"{requirement} ({where}): at least {needed} for "
                           f"{NEEDED[name][1] if name in NEEDED else 'this extra'}")
    assert too_low == []


def test_every_installed_package_meets_its_pins():
    unmet = []
    for where, requirement in requirements():
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            continue  # an extra that is not installed here
        if not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(f"{requirement} ({where}): {installed} is installed")
    assert unmet == []


READ_BACK = """
import json, sys
from importlib.metadata import version
from pathlib import Path

import gguf

from qatune.export.gguf import export_gguf
from qatune.kinds import answer_questions
from qatune.model.gguf_file import load_gguf_run, read_gguf_run

run, out = Path(sys.argv[1]), Path(sys.argv[2])
_, check = export_gguf(run, out, "q8_0", rows=4, answer_rows=1)
config, info = read_gguf_run(out)
loaded = load_gguf_run(out, device="cpu")
answer = answer_questions(loaded.model, loaded.tokenizer, loaded.info, ["who wrote it?"])[0]
print(json.dumps({"gguf": version("gguf"), "from": gguf.__file__, "passed": check.passed(),
                  "prompt": info.prompt_template == loaded.info.prompt_template, "answer": answer}))
"""


@pytest.mark.slow
@pytest.mark.external
def test_gguf_at_its_floor_writes_and_reads_a_file(serve_run, tmp_path):
    """pip install gguf==<floor> into a scratch environment that sees this one's other packages: qatune writes a
    file with it (the export's check reading it back through transformers) and reads its config and prompt."""
    gguf_floor = min(floor(r) for _, r in requirements() if canonicalize_name(r.name) == "gguf")
    scratch = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(scratch)
    python = scratch / "bin" / "python"
    shown = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True,
                           text=True, check=True).stdout.strip()
    with open(os.path.join(shown, "qatune-under-test.pth"), "w", encoding="utf-8") as pth:
        pth.write(f"{site.getsitepackages()[0]}\n{ROOT / 'src'}\n{ROOT}\n")
    installed = subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"gguf=={gguf_floor}"],
                               capture_output=True, text=True, timeout=600)
    if installed.returncode != 0:
        pytest.skip(f"pip install gguf=={gguf_floor} failed (no PyPI here?): {installed.stderr.strip()[-300:]}")
    done = subprocess.run([str(python), "-c", READ_BACK, str(serve_run), str(tmp_path / "floor.gguf")],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Version(result["gguf"]) == gguf_floor and result["from"].startswith(str(scratch))
    assert result["passed"] and result["prompt"] and isinstance(result["answer"], str)
