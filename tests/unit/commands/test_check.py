"""qatune check's rendering of what a row trains."""

from qatune.train import prepare
from tests.conftest import MIXED_ROWS, one_epoch_config


def test_check_shows_a_rows_tokens_without_the_padding_a_rounded_width_adds(tmp_path):
    from qatune.commands.check import render_trained_tokens

    prepared = prepare(one_epoch_config(tmp_path, MIXED_ROWS))
    example = prepared.dataset[0]
    plain = render_trained_tokens(prepared, example)
    prepared.collator.pad_to_multiple_of = len(example) + 7
    assert render_trained_tokens(prepared, example) == plain
