"""Exports of a trained run for other tools: a plain transformers folder with LoRA adapters merged
(merged.py), and a GGUF file for llama.cpp and Ollama (gguf.py: written by gguf_write.py, its prompt in
gguf_prompt.py, checked by gguf_check.py)."""

from qatune.errors import QatuneError


class ExportError(QatuneError):
    """A run that cannot be written as a GGUF file, or a file that does not answer as the run does."""
