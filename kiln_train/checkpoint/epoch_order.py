"""Deterministic per-epoch data order, algorithm `kiln-py.epoch-order.v1`.

docs/training-profile.md#data-order.

The Rust implementation (`kiln.epoch-order.v1`) shuffles with Rust's ChaCha12 `StdRng`, which this
project does not reproduce, so it records its own algorithm name in every checkpoint instead:

`kiln-py.epoch-order.v1`, for a u64 `seed`, a u64 `epoch` and an item count `n`:

1. Byte stream. Block `c` (c = 0, 1, 2, ...) is
   `SHA-256(b"kiln-py.epoch-order.v1\\0" || u64be(seed) || u64be(epoch) || u64be(c))`;
   the stream is block 0, block 1, ... concatenated. It is consumed as successive unsigned 64-bit
   big-endian words, four per block.
2. Unbiased draw of `j` uniform in `[0, bound)`: let `limit = 2**64 - (2**64 mod bound)`; take
   the next word `w`; if `w >= limit` discard it and take the next; otherwise `j = w mod bound`.
3. Fisher–Yates: start from `[0, 1, ..., n-1]`; for `i = n-1` down to `1` draw `j` with
   `bound = i + 1` and swap positions `i` and `j`. `n = 0` gives `[]`, `n = 1` gives `[0]`.

Pure Python integer arithmetic and SHA-256: identical on every platform, no torch, no numpy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

EPOCH_ORDER_ALGORITHM = "kiln-py.epoch-order.v1"
_DOMAIN = EPOCH_ORDER_ALGORITHM.encode("ascii") + b"\0"
_U64_MAX = 2**64 - 1
_TWO_64 = 2**64


def _check_u64(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _U64_MAX:
        raise ValueError(f"{name} must be an unsigned 64-bit integer, got {value!r}")


def _words(seed: int, epoch: int) -> Iterator[int]:
    """The endless stream of u64 words for (seed, epoch), step 1 of the module docstring."""
    prefix = _DOMAIN + seed.to_bytes(8, "big") + epoch.to_bytes(8, "big")
    counter = 0
    while True:
        block = hashlib.sha256(prefix + counter.to_bytes(8, "big")).digest()
        for k in range(0, 32, 8):
            yield int.from_bytes(block[k : k + 8], "big")
        counter += 1


def _draw_below(words: Iterator[int], bound: int) -> int:
    """Uniform integer in [0, bound) by rejection (no modulo bias), step 2."""
    limit = _TWO_64 - (_TWO_64 % bound)
    while True:
        w = next(words)
        if w < limit:
            return w % bound


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """The permutation of `range(n)` used for epoch `epoch` of a run seeded with `seed`."""
    _check_u64("seed", seed)
    _check_u64("epoch", epoch)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    order = list(range(n))
    words = _words(seed, epoch)
    for i in range(n - 1, 0, -1):
        j = _draw_below(words, i + 1)
        order[i], order[j] = order[j], order[i]
    return order
