"""train.precision: auto resolved to bf16 only where bf16 is native, and said so."""

import json
import math

import pytest

from qatune.train import prepare
from tests.conftest import MIXED_ROWS, one_epoch_config


@pytest.mark.parametrize(("native", "expected"), [(True, "bf16"), (False, "fp32")])
def test_precision_auto_is_bf16_only_where_it_is_native(monkeypatch, native, expected):
    from qatune.model import precision as device

    monkeypatch.setattr(device, "bf16_native", lambda where, unknown=True: native)
    assert device.resolve_precision("auto", "cpu") == expected
    assert device.resolve_precision("fp32", "cpu") == "fp32"      # an explicit choice is kept


@pytest.mark.parametrize(("variable", "cap", "allowed"), [
    ("ONEDNN_MAX_CPU_ISA", "AVX2", False), ("ONEDNN_MAX_CPU_ISA", "avx512_core", False),
    ("DNNL_MAX_CPU_ISA", "AVX512_CORE_VNNI", False), ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX", True),
    ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", True), ("ONEDNN_MAX_CPU_ISA", "ALL", True)])
def test_bf16_is_not_native_where_onednn_is_capped_below_it(monkeypatch, variable, cap, allowed):
    # Capped below AVX512-BF16, oneDNN emulates bf16 whatever the CPU's flags say (hundreds of times slower).
    from qatune.model import precision as device

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    uncapped = device.bf16_native("cpu", unknown=True)
    monkeypatch.setenv(variable, cap)
    assert device.onednn_cap() == (None if allowed else f"{variable}={cap}")
    assert device.bf16_native("cpu", unknown=True) is (uncapped and allowed)
    if not allowed:
        assert device.resolve_precision("auto", "cpu") == "fp32"


def test_precision_auto_names_the_onednn_cap_that_ruled_bf16_out(tmp_path, monkeypatch, caplog):
    import logging

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    with caplog.at_level(logging.INFO, logger="qatune"):
        prepared = prepare(one_epoch_config(tmp_path, MIXED_ROWS, "train.precision=auto", "train.device=cpu"))
    assert prepared.precision == "fp32"
    assert ("precision: fp32 (train.precision auto: bf16 is not native: ONEDNN_MAX_CPU_ISA=AVX2 holds oneDNN "
            "below AVX512-BF16)") in caplog.messages


def test_precision_auto_is_logged_and_saved_in_run_json(tmp_path, monkeypatch):
    from qatune.model import precision as device
    from qatune.train import train

    monkeypatch.setattr(device, "bf16_native", lambda where, unknown=True: True)
    run = train(one_epoch_config(tmp_path, MIXED_ROWS, "train.precision=auto"), output_dir=tmp_path / "run",
                progress=False)
    assert json.loads((run / "run.json").read_text())["precision"] == "bf16"
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert losses and all(math.isfinite(x) for x in losses)
    import yaml

    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["precision"] == "auto"   # as asked
