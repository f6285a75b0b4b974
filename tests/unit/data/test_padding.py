"""The width a batch is padded to."""

import pytest


@pytest.mark.parametrize(("longest", "multiple", "limit", "width"), [
    (9, 8, None, 16), (9, 8, 10, 10), (9, 8, 16, 16), (17, 2, 17, 17), (16, 2, 17, 16), (9, 1, 9, 9)])
def test_a_rounded_width_stops_at_the_models_positions(longest, multiple, limit, width):
    from qatune.data.padding import batch_width

    assert batch_width(longest, multiple, limit) == width


def test_bucketed_widths_are_few_and_at_most_an_eighth_longer():
    """bf16 on a CPU keeps kernels for every shape it meets: every width from 1 to 2048 becomes one of 72 sizes,
    none more than an eighth longer than the batch's longest row (short rows keep their width)."""
    from qatune.data.padding import batch_width, bucket

    widths = {w: bucket(w) for w in range(1, 2049)}
    assert len(set(widths.values())) == 72  # 1-15, then eight sizes an octave up to 2048
    assert all(w <= b <= w * 9 / 8 for w, b in widths.items())
    assert [bucket(w) for w in (7, 15, 17, 21, 100, 257, 300, 507, 512, 513)] == [7, 15, 18, 22, 104, 288, 320, 512,
                                                                                  512, 576]
    assert batch_width(300, 2, None, bucketed=True) == 320 and batch_width(300, 2, 310, bucketed=True) == 310


def test_bf16_on_a_cpu_pads_every_collator_to_few_widths():
    from qatune.data.generative import CausalCollator, Example
    from qatune.train.heap import few_shapes

    collator = CausalCollator(pad_token_id=0)
    assert not few_shapes(collator, "fp32", "cpu") and not few_shapes(collator, "bf16", "cuda")
    assert not collator.bucketed
    assert few_shapes(collator, "bf16", "cpu") and collator.bucketed
    batch = collator([Example(list(range(1, 101)), 90, 0), Example(list(range(1, 61)), 50, 1)])
    assert batch["input_ids"].shape == (2, 104) and int(batch["attention_mask"].sum()) == 160
