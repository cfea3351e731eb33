"""`kiln-py.seeded-lora-init.v1` without torch: the exact adapter Kiln's trainer starts from.

`kiln_train.model.lora.attach_lora` draws every A with `Tensor.uniform_(-b, b, generator=gen)`
on one CPU `torch.Generator` seeded with the run's seed (b = sqrt(1/in), projections in model
order) and sets every B to zero. An export bundle ships that starting point so TRL starts where
Kiln would, and the api builds it without torch, so this module reproduces torch's CPU stream:

- The generator is MT19937 seeded with the low 32 bits of the seed (torch's `mt19937(seed)`
  runs the standard `init_genrand` on `seed & 0xffffffff`). Python's `random` module is the same
  MT19937, so its state is set to the seeded one and `getrandbits(32 * n)` yields the next `n`
  tempered 32-bit words, least significant word first.
- Each float32 draw keeps the low 24 bits `k` of one word: `x = k * 2**-24`, and the value is
  `x * (to - from) + from` rounded once to float32 (torch's CPU kernel evaluates it as one fused
  multiply-add). With `from = -b`, `to = b` in float32, `k * (2b) * 2**-24 - b` is exact in a
  double (its integer mantissa stays under 2**47), so converting that double to float32 is that
  single rounding.

`tests/kiln_train/interop/test_lora_init.py` checks the bytes against `attach_lora` itself, so a
torch that draws differently fails the suite instead of shipping a different start.
"""

from __future__ import annotations

import math
import random
import struct
import sys
from array import array

from kiln_train.artifacts.adapter import PEFT_PREFIX
from kiln_train.model.config import LORA_INIT_ALGORITHM, Qwen35Config

MT_N = 624
_LOW24 = (1 << 24) - 1

__all__ = ["LORA_INIT_ALGORITHM", "seeded_lora_tensors", "mt19937_state"]


def mt19937_state(seed: int) -> list[int]:
    """The 624-word MT19937 state after `init_genrand(seed & 0xffffffff)`."""
    state = [seed & 0xFFFFFFFF]
    for i in range(1, MT_N):
        prev = state[-1]
        state.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    return state


def _generator(seed: int) -> random.Random:
    gen = random.Random()
    gen.setstate((3, (*mt19937_state(seed), MT_N), None))  # index 624: twist before the first draw
    return gen


def _f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _uniform_f32(gen: random.Random, count: int, bound: float) -> bytes:
    """`count` float32 draws of `uniform_(-bound, bound)`, little-endian bytes."""
    b = _f32(bound)
    step = (b - -b) * 2.0**-24
    words = array("I")
    words.frombytes(gen.getrandbits(32 * count).to_bytes(4 * count, "little"))
    if sys.byteorder == "big":
        words.byteswap()
    values = array("f", [(w & _LOW24) * step - b for w in words])
    if sys.byteorder == "big":
        values.byteswap()
    return values.tobytes()


def seeded_lora_tensors(
    config: Qwen35Config, rank: int, seed: int
) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """PEFT key -> ("F32", shape, bytes) of the adapter `attach_lora(model, rank, alpha, seed)`
    creates on a float32 model of shape `config` (A drawn, B zero)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora rank must be a positive integer, got {rank!r}")
    gen = _generator(int(seed))
    out: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for proj in config.projections():
        key = f"{PEFT_PREFIX}{proj.module}"
        a = _uniform_f32(gen, rank * proj.in_features, math.sqrt(1.0 / proj.in_features))
        out[f"{key}.lora_A.weight"] = ("F32", (rank, proj.in_features), a)
        out[f"{key}.lora_B.weight"] = ("F32", (proj.out_features, rank), bytes(4 * proj.out_features * rank))
    return out
