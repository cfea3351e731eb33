"""`kiln-py.epoch-order.v1` (kiln-contract §5.4): golden values, the documented byte stream, uniformity."""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter

import pytest

from kiln_train.checkpoint import epoch_order

U64 = 2**64 - 1


def _word(seed: int, epoch: int, index: int) -> int:
    """Word `index` of the stream, computed straight from the module docstring's formula."""
    block = hashlib.sha256(
        b"kiln-py.epoch-order.v1\0"
        + seed.to_bytes(8, "big")
        + epoch.to_bytes(8, "big")
        + (index // 4).to_bytes(8, "big")
    ).digest()
    k = (index % 4) * 8
    return int.from_bytes(block[k : k + 8], "big")


@pytest.mark.parametrize(
    ("seed", "epoch", "n", "expected"),
    [
        (0, 0, 10, [3, 5, 1, 8, 4, 6, 2, 7, 0, 9]),
        (1, 0, 10, [0, 5, 9, 4, 8, 7, 2, 3, 1, 6]),
        (1, 1, 10, [4, 7, 1, 5, 3, 0, 8, 2, 9, 6]),
        (U64, 3, 16, [14, 9, 5, 6, 3, 0, 15, 8, 12, 4, 1, 10, 13, 2, 11, 7]),
        (
            7,
            2,
            25,
            [13, 4, 8, 20, 9, 11, 0, 10, 21, 23, 1, 16, 5, 15, 22, 6, 14, 17, 24, 18, 2, 12, 3, 7, 19],
        ),
        (42, 0, 0, []),
        (42, 0, 1, [0]),
    ],
)
def test_golden_orders(seed, epoch, n, expected):
    assert epoch_order(seed, epoch, n) == expected


def test_matches_the_documented_stream_for_small_n():
    # n = 2: one draw j with bound 2 (2**64 is a multiple of 2, so never rejected); i=1 and j
    # swap, so the order changes iff j == 0.
    for seed in range(20):
        swapped = _word(seed, 0, 0) % 2 == 0
        assert epoch_order(seed, 0, 2) == ([1, 0] if swapped else [0, 1])
    # n = 3: first draw bound 3 at i=2, second draw bound 2 at i=1 (rejection is astronomically rare).
    seed, epoch = 99, 4
    order = [0, 1, 2]
    j = _word(seed, epoch, 0) % 3
    order[2], order[j] = order[j], order[2]
    j = _word(seed, epoch, 1) % 2
    order[1], order[j] = order[j], order[1]
    assert epoch_order(seed, epoch, 3) == order


def test_is_a_permutation_and_depends_on_seed_and_epoch():
    orders = {(s, e): tuple(epoch_order(s, e, 50)) for s in (0, 1, 2**63) for e in (0, 1, 2)}
    for order in orders.values():
        assert sorted(order) == list(range(50))
    assert len(set(orders.values())) == len(orders)
    assert epoch_order(5, 1, 50) == epoch_order(5, 1, 50)


def test_all_permutations_of_four_are_roughly_uniform():
    counts = Counter(tuple(epoch_order(seed, 0, 4)) for seed in range(4800))
    assert set(counts) == set(itertools.permutations(range(4)))
    # 24 outcomes, 200 expected each: a biased shuffle (e.g. j drawn from [0, n)) falls far outside.
    chi2 = sum((c - 200) ** 2 / 200 for c in counts.values())
    assert chi2 < 60.0


@pytest.mark.parametrize(
    ("seed", "epoch", "n"), [(-1, 0, 3), (2**64, 0, 3), (0, -1, 3), (0, 0, -1), (True, 0, 3)]
)
def test_rejects_out_of_range_arguments(seed, epoch, n):
    with pytest.raises(ValueError):
        epoch_order(seed, epoch, n)
