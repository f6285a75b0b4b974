"""The layering of src/qatune, written down as import-linter contracts in pyproject.toml, holds."""

import shutil
import subprocess
import sys

from tests.conftest import ROOT


def test_the_import_contracts_are_kept():
    linter = shutil.which("lint-imports", path=str(ROOT / ".venv" / "bin")) or shutil.which("lint-imports")
    assert linter, "import-linter is not installed (pip install -e '.[test]')"
    done = subprocess.run([linter, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": f"{sys.prefix}/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 kept, 0 broken" in done.stdout


def test_every_package_of_qatune_is_a_layer():
    import tomllib  # the standard library's from Python 3.11 (the package itself supports 3.10)

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    named = {name.strip() for layer in layers for name in layer.split("|")}
    packages = {f"qatune.{p.name}" for p in (ROOT / "src" / "qatune").iterdir()
                if (p / "__init__.py").is_file()}
    assert packages <= named, packages - named
