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


def test_every_module_is_in_the_architecture_tree():
    """docs/architecture.md's tree names every module of src/qatune under its folder, so that a new module comes
    with its line (the tree is where a reader looks a concern up)."""
    import re

    tree = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split("```")[1]
    listed, folder = set(), ""
    for line in tree.splitlines():
        found = re.match(r"( *)(\S+)", line)
        if not found:
            continue
        indent, name = len(found[1]), found[2]
        if indent == 2 and name.endswith("/"):
            folder = name
        elif indent == 4 and name.endswith(".py"):
            listed.add(folder + name)
        elif indent == 2 and name.endswith(".py"):
            listed.add(name)
    source = ROOT / "src" / "qatune"
    modules = {str(p.relative_to(source)) for p in source.rglob("*.py") if p.name != "__init__.py"}
    assert modules <= listed, sorted(modules - listed)
