"""The width a batch is padded to."""

import pytest


@pytest.mark.parametrize(("longest", "multiple", "limit", "width"), [
    (9, 8, None, 16), (9, 8, 10, 10), (9, 8, 16, 16), (17, 2, 17, 17), (16, 2, 17, 16), (9, 1, 9, 9)])
def test_a_rounded_width_stops_at_the_models_positions(longest, multiple, limit, width):
    from qatune.data.padding import batch_width

    assert batch_width(longest, multiple, limit) == width
