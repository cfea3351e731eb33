"""Reading and writing safetensors files without torch (the api never imports it).

The format: an 8-byte little-endian header length `N`, `N` bytes of JSON (`{name: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__"?: {str: str}}`, offsets relative to the
end of the header), then the tensor bytes, little-endian, row-major. `parse` holds a file to the
rules the reference implementation enforces (known dtypes, sizes that match the shapes, offsets
that tile the data exactly, no duplicate names) and names the first thing that breaks them;
`dump` writes names sorted, tensors packed in that order and the header padded with spaces to a
multiple of 8 bytes, which `safetensors.torch.load` reads.

`first_non_finite` finds the first NaN or infinity of a floating-point tensor from its exponent
bits alone (byte slices and integer masks, no per-element Python loop), so a multi-GB adapter is
checked in seconds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from kiln_train.ground import json_bounded

HEADER_LIMIT = 100 * 1024 * 1024  # the reference implementation's own ceiling
METADATA_KEY = "__metadata__"

ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class SafetensorsError(ValueError):
    """The bytes are not a well-formed safetensors file; the message names the first problem."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offsets into the file's bytes
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsFile:
    data: bytes
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None

    def raw(self, name: str) -> bytes:
        info = self.tensors[name]
        return self.data[info.begin : info.end]


def _unique_object(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise SafetensorsError(f"the header names {key!r} twice")
        out[key] = value
    return out


def parse(data: bytes) -> SafetensorsFile:
    """The header of a safetensors file held in `data`, validated against the data it describes."""
    if len(data) < 8:
        raise SafetensorsError(f"{len(data)} bytes is too short for a safetensors header")
    length = int.from_bytes(data[:8], "little")
    if length < 2 or length > HEADER_LIMIT or 8 + length > len(data):
        raise SafetensorsError(f"header length {length} does not fit a {len(data)}-byte file")
    try:
        header = json_bounded.loads(data[8 : 8 + length], object_pairs_hook=_unique_object)
    except SafetensorsError:
        raise
    except (UnicodeDecodeError, ValueError) as exc:
        raise SafetensorsError(f"the header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("the header is not a JSON object")
    start = 8 + length
    available = len(data) - start
    metadata = header.pop(METADATA_KEY, None)
    if metadata is not None and (
        not isinstance(metadata, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise SafetensorsError("__metadata__ must map strings to strings")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        tensors[name] = _tensor_info(name, entry, start, available)
    spans = sorted((t.begin, t.end, n) for n, t in tensors.items())
    cursor = start
    for begin, end, name in spans:
        if begin != cursor:
            what = "overlaps the tensor before it" if begin < cursor else "leaves a gap before it"
            raise SafetensorsError(f"tensor {name!r} {what} (data offsets must tile the data)")
        cursor = end
    if cursor != len(data):
        raise SafetensorsError(f"{len(data) - cursor} byte(s) after the last tensor belong to no tensor")
    return SafetensorsFile(data, tensors, metadata)


def _tensor_info(name: str, entry: object, start: int, available: int) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise SafetensorsError(f"tensor {name!r}: an entry has exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in ITEMSIZE:
        raise SafetensorsError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise SafetensorsError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= available
    ):
        raise SafetensorsError(f"tensor {name!r}: data_offsets {offsets!r} do not lie in the data")
    size = math.prod(shape) * ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != size:
        raise SafetensorsError(
            f"tensor {name!r}: {dtype} {shape} needs {size} bytes, its offsets span {offsets[1] - offsets[0]}"
        )
    return TensorInfo(dtype, tuple(shape), start + offsets[0], start + offsets[1])


def dump(
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]], metadata: dict[str, str] | None = None
) -> bytes:
    """A safetensors file of `tensors` (name -> (dtype, shape, little-endian bytes)), names sorted."""
    header: dict = {}
    if metadata is not None:
        header[METADATA_KEY] = dict(metadata)
    offset = 0
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        size = math.prod(shape) * ITEMSIZE[dtype]
        if len(raw) != size:
            raise ValueError(f"tensor {name!r}: {dtype} {list(shape)} needs {size} bytes, got {len(raw)}")
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return b"".join([len(text).to_bytes(8, "little"), text, *(tensors[n][2] for n in sorted(tensors))])


def _flag_table(mask: int) -> bytes:
    """A bytes.translate table: 1 where all of `mask`'s bits are set in the byte, else 0."""
    return bytes(1 if b & mask == mask else 0 for b in range(256))


# dtype -> (bytes per element, (offset of a byte in the element, its exponent mask), ...): an
# element is NaN or infinite exactly when every exponent bit is set.
_EXPONENT_BYTES = {
    "F32": (4, ((3, 0x7F), (2, 0x80))),
    "BF16": (2, ((1, 0x7F), (0, 0x80))),
    "F16": (2, ((1, 0x7C),)),
    "F64": (8, ((7, 0x7F), (6, 0xF0))),
}
_TABLES = {mask: _flag_table(mask) for _, parts in _EXPONENT_BYTES.values() for _, mask in parts}


def first_non_finite(dtype: str, raw: bytes) -> int | None:
    """Index of the first NaN or infinite element of a little-endian float tensor, or None."""
    size, parts = _EXPONENT_BYTES[dtype]
    count = len(raw) // size
    if count == 0:
        return None
    flags = None
    for offset, mask in parts:
        lane = int.from_bytes(raw[offset::size].translate(_TABLES[mask]), "little")
        flags = lane if flags is None else flags & lane
    if not flags:
        return None
    return flags.to_bytes(count, "little").find(1)
