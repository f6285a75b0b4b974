"""Exports of a trained run for other tools: a plain transformers folder with LoRA adapters merged
(merged.py)."""
