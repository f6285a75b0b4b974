"""malloc_reuse: glibc's malloc keeps freed memory while training and hands it back afterwards."""

import os

import pytest

from qatune.train import fit, prepare
from tests.conftest import MIXED_ROWS, one_epoch_config

GLIBC = (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc") if hasattr(os, "confstr") else False


@pytest.mark.slow  # a Python process per case, each importing torch
@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
@pytest.mark.parametrize(("env", "expected"), [
    ({}, "True"),
    ({"MALLOC_TRIM_THRESHOLD_": "131072"}, "False"),                  # the user's own setting wins
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "False"),
])
def test_glibc_is_told_to_keep_freed_memory_unless_the_user_set_it(env, expected):
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    code = "from qatune.speedups.malloc_reuse import keep_freed_memory as k; print(k())"
    done = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == expected


@pytest.mark.slow  # a Python process that imports torch and fills 400 MB
@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_kept_freed_memory_is_handed_back_to_the_kernel():
    import subprocess
    import sys

    # 400 MB in 4 MB tensors, freed: kept in the heap (below the raised mmap threshold), then handed back.
    code = (
        "import torch\n"
        "from qatune.speedups.malloc_reuse import hand_back_freed_memory, keep_freed_memory\n"
        "def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096 >> 20\n"
        "assert keep_freed_memory()\n"
        "held = [torch.ones(1 << 20) for _ in range(100)]\n"
        "del held\n"
        "kept = rss()\n"
        "assert hand_back_freed_memory()\n"
        "print(kept - rss())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert int(done.stdout) > 300


def test_cpu_training_asks_for_freed_memory_to_be_kept_and_hands_it_back_at_the_end(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("qatune.speedups.malloc_reuse.keep_freed_memory", lambda: calls.append("keep") or True)
    monkeypatch.setattr("qatune.speedups.malloc_reuse.hand_back_freed_memory",
                        lambda: calls.append("hand back") or True)
    fit(prepare(one_epoch_config(tmp_path, MIXED_ROWS)), None, progress=False)
    assert calls == ["keep", "hand back"]
