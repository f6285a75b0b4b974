"""LengthGroupedBatches: every row once an epoch, rows of like length together, families of rows about one
context kept in one batch where they fit."""

from qatune.train import LengthGroupedBatches


def test_length_grouped_batches_cover_everything_once_and_reduce_padding():
    lengths = [(i * 37) % 101 + 1 for i in range(400)]
    sampler = LengthGroupedBatches(lengths, batch_size=8, seed=3)
    first = list(sampler)
    assert sorted(i for batch in first for i in batch) == list(range(400))
    assert len(first) == len(sampler) == 50
    padding = sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in first)
    plain = list(LengthGroupedBatches(lengths, batch_size=8, seed=3, group=False))
    plain_padding = sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in plain)
    assert padding < plain_padding / 5
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_every_epoch_ends_with_its_heaviest_batch():
    lengths = [(i * 37) % 101 + 1 for i in range(400)]
    lengths[123] = 300  # the longest row: its batch is the heaviest, whichever rows the shuffle puts beside it
    sampler = LengthGroupedBatches(lengths, batch_size=8, seed=3)
    for epoch in range(4):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert 123 in batches[-1] and len(batches[-1]) == 8
        assert sorted(i for batch in batches for i in batch) == list(range(400))
    heavy = [50] * 2 + [5] * 14  # two batches of 8: the one holding both long rows is the heaviest, moved last
    for epoch in range(4):
        sampler = LengthGroupedBatches(heavy, batch_size=8, seed=epoch)
        assert {0, 1} <= set(list(sampler)[-1])
    plain = LengthGroupedBatches(lengths, batch_size=8, seed=3, group=False)
    lasts = []
    for epoch in range(4):
        plain.set_epoch(epoch)
        lasts.append(list(plain)[-1])
    assert not all(123 in last for last in lasts)  # plain shuffled batches stay as the shuffle put them


def test_families_stay_together_and_singletons_keep_the_plain_order():
    lengths = [(i * 37) % 101 + 1 for i in range(400)]
    singletons = [[i] for i in range(400)]
    for group in (True, False):
        assert list(LengthGroupedBatches(lengths, 8, seed=3, group=group, families=singletons)) == \
            list(LengthGroupedBatches(lengths, 8, seed=3, group=group))
    families = [list(range(start, min(start + 5, 400))) for start in range(0, 400, 5)]  # 80 contexts of 5 rows
    for group in (True, False):
        batches = list(LengthGroupedBatches(lengths, 8, seed=3, group=group, families=families))
        assert sorted(i for batch in batches for i in batch) == list(range(400)) and len(batches) == 50
        # A family of 5 in batches of 8 lies in one batch or in two: never spread wider.
        spread = [len({b for b, batch in enumerate(batches) for i in batch if i in family}) for family in families]
        assert max(spread) == 2 and spread.count(1) >= 30
        plain = list(LengthGroupedBatches(lengths, 8, seed=3, group=group))
        plain_spread = [len({b for b, batch in enumerate(plain) for i in batch if i in family}) for family in families]
        assert sum(plain_spread) > 3 * sum(spread)  # shuffled alone: nearly every row in a batch of its own


def test_batches_are_filled_with_whole_families_where_one_fits():
    sizes = [5, 3, 3, 5] * 25  # 100 families, 400 rows: 50 batches of 5 + 3 need no family split
    families, start = [], 0
    for size in sizes:
        families.append(list(range(start, start + size)))
        start += size
    for group in (True, False):
        batches = list(LengthGroupedBatches([10] * 400, 8, seed=5, group=group, families=families))
        assert len(batches) == 50 and all(len(batch) == 8 for batch in batches)
        where = {i: b for b, batch in enumerate(batches) for i in batch}
        assert all(len({where[i] for i in family}) == 1 for family in families)
