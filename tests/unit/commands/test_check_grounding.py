"""qatune check says how the training answers relate to their passages and whether answers will be grounded."""

import pytest

from qatune.commands.check import render_report, run_check
from tests.conftest import SPAN_ROWS, tiny_config


@pytest.mark.slow
def test_check_gives_the_share_of_span_answers_and_the_grounding_it_leads_to(tmp_path):
    rows = [*SPAN_ROWS, ("what is thing 9?", "thing 9 is grey.", "a colour")]
    report = run_check(tiny_config(tmp_path, rows, "data.context_column=context"))
    assert report["grounding"] == {"rows": 6, "spans": 5, "no_answer": None, "no_answer_rows": 0, "auto": False,
                                   "share": 0.8333, "setting": "auto", "on": False}
    text = render_report(report)
    assert ("Grounded answers\n  5 of 6 training answers (83.3%) are spans of their passage; generate.grounded auto: "
            "off\n  generate.grounded: auto: eval, generate and serve answer freely") in text
    on = run_check(tiny_config(tmp_path, SPAN_ROWS, "data.context_column=context"))["grounding"]
    assert (on["share"], on["auto"], on["on"]) == (1.0, True, True)
