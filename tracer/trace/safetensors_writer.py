"""Write a dict of CPU tensors as one safetensors file, without the library's per-tensor Python.

The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian
header size ``N``; ``N`` bytes of JSON, ``{"__metadata__": {str: str}, name: {"dtype": "BF16",
"shape": [...], "data_offsets": [begin, end]}, ...}``, padded with spaces; then the tensors'
bytes, little-endian and row-major, each at its offsets counted from the end of the header.
As the library does, the tensors are laid out by element size, largest first, after a header
padded to a multiple of 8 bytes: every tensor then starts aligned to its element size, which
a reader that maps the file needs.
Files written here are read by ``safetensors.safe_open`` like the library's own (tests compare
both, dtype by dtype).

Why not ``safetensors.torch.save_file``: it spends ~25 us of Python per tensor (a numpy view,
shared-storage and contiguity checks) before its Rust writer runs; a step of the demo model
traces 462 small tensors, and that was 12 ms of its full-mode flush, ~40% of it. Here a
tensor costs a header entry and its bytes: a large tensor is written from its own memory
(the buffer protocol, no copy), consecutive small ones are joined into one write.
"""
from __future__ import annotations

import struct
import sys
from typing import BinaryIO

import orjson
import torch

__all__ = ["SAFETENSORS_DTYPES", "write_safetensors"]

#: tensors of fewer bytes are copied into one buffer with their neighbours and written at once
#: (a buffered write costs ~6 us, the copy of a small tensor less); larger ones are written
#: from their own memory
_JOIN_BELOW = 1 << 16

#: torch dtype -> the format's dtype name, for every dtype ``safetensors.torch`` reads back
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
    **{getattr(torch, attr): name for attr, name in (
        ("float8_e4m3fn", "F8_E4M3"), ("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2", "F8_E5M2"),
        ("float8_e5m2fnuz", "F8_E5M2FNUZ"), ("uint64", "U64"), ("uint32", "U32"), ("uint16", "U16"))
       if hasattr(torch, attr)},
}


def write_safetensors(f: BinaryIO, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write ``tensors`` (CPU, contiguous) with ``metadata`` to the open binary
    file ``f``; returns the bytes written. Raises ``ValueError`` naming a tensor that is not
    a contiguous CPU tensor of a dtype the format has (:data:`SAFETENSORS_DTYPES`), before
    anything is written; ``OSError`` from the writes (a full disk) propagates."""
    if sys.byteorder != "little":  # the bytes are written as they lie in memory
        raise NotImplementedError("safetensors stores little-endian data; this machine is big-endian")
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    order = sorted(tensors.items(), key=lambda item: -item[1].element_size())  # stable: dict order within a size
    for key, t in order:
        name = SAFETENSORS_DTYPES.get(t.dtype)
        if name is None:
            raise ValueError(f"tensor {key!r}: safetensors has no dtype for {t.dtype}")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"tensor {key!r}: expected a contiguous CPU tensor")
        size = t.numel() * t.element_size()
        header[key] = {"dtype": name, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = orjson.dumps(header)
    text += b" " * (-len(text) % 8)  # the tensors start 8-byte aligned, as the library writes them
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    small: list[memoryview] = []  # consecutive small tensors, joined into one write
    for _, t in order:
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        if data.nbytes < _JOIN_BELOW:
            small.append(data)
            continue
        f.write(b"".join(small))
        small.clear()
        f.write(data)
    f.write(b"".join(small))
    return 8 + len(text) + offset
