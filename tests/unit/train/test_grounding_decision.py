"""generate.grounded auto is decided when a run trains: on for training answers that are spans of their passages,
off for answers written in other words, none for a run without passages; on is refused where it cannot apply."""

import pytest

from qatune.errors import ConfigError
from qatune.train import prepare
from tests.conftest import SPAN_ROWS, tiny_config


def decided(tmp_path, rows, *overrides):
    return prepare(tiny_config(tmp_path, rows, "data.context_column=context", *overrides), with_model=False).info


def test_span_answers_turn_auto_on_and_written_answers_leave_it_off(tmp_path):
    assert decided(tmp_path, SPAN_ROWS).grounding == {"rows": 5, "spans": 5, "no_answer": None, "no_answer_rows": 0,
                                                      "auto": True, "share": 1.0}
    written = [(q, c, f"the colour {a}") for q, c, a in SPAN_ROWS]  # not a span: "the colour red"
    assert decided(tmp_path, written).grounding == {"rows": 5, "spans": 0, "no_answer": None, "no_answer_rows": 0,
                                                    "auto": False, "share": 0.0}


def test_a_run_without_passages_has_no_grounding_and_refuses_on(tmp_path):
    rows = [(q, a) for q, _, a in SPAN_ROWS]
    assert prepare(tiny_config(tmp_path, rows), with_model=False).info.grounding is None
    with pytest.raises(ConfigError, match=r"generate\.grounded on: .* \(its prompt has no \{context\}\)"):
        prepare(tiny_config(tmp_path, rows, "generate.grounded=on"), with_model=False)
