"""What a bug report needs: versions, devices and threads."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

from qatune import __version__

_PACKAGES = ["torch", "transformers", "tokenizers", "accelerate", "pandas", "numpy", "openpyxl", "peft", "gguf"]


def environment() -> dict[str, str]:
    info = {
        "qatune": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": str(os.cpu_count()),
    }
    for name in _PACKAGES:
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = "not installed"
    from qatune.model.packaged import PACKAGED_MODELS, installed_packaged_models

    packaged = installed_packaged_models()
    info["packaged_models"] = ", ".join(
        f"{name} ({folder}" + (f"; {PACKAGED_MODELS[name].terms})" if PACKAGED_MODELS[name].terms else ")")
        for name, folder in packaged.items()) or "none"
    from qatune.model.gguf_cache import summary

    info["gguf_cache"] = summary()
    try:
        import torch
    except ImportError:
        return info
    info["torch_threads"] = str(torch.get_num_threads())
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["device"] = f"cuda ({', '.join(names)}), CUDA {torch.version.cuda}"
        info["bf16"] = str(torch.cuda.is_bf16_supported())
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        info["device"] = "mps"
    else:
        info["device"] = "cpu"
    info["hf_hub_offline"] = os.environ.get("HF_HUB_OFFLINE", "0")
    return info

