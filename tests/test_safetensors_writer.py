"""tracer.trace.safetensors_writer: files that safetensors itself reads back as its own writer's."""
import io
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tracer.trace.safetensors_writer import SAFETENSORS_DTYPES, write_safetensors


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Values of every bit pattern kind: random bits reinterpreted as ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.tensor(shape).prod()) if shape else 1
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _read(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_every_dtype_reads_back_bit_exactly_as_from_the_library(tmp_path):
    shapes = [(3, 5), (), (0, 4), (7,), (2, 3, 4)]
    tensors = {f"{name}/{i}": _sample(dtype, shape, seed=i)
               for i, (dtype, name) in enumerate(SAFETENSORS_DTYPES.items())
               for shape in shapes[i % len(shapes):][:2]}
    # tensors over the join size, written from their own memory, between small ones
    tensors.update({"big/f32": _sample(torch.float32, (128, 160), 90), "big/bf16": _sample(torch.bfloat16, (40961,), 91),
                    "small/bf16": _sample(torch.bfloat16, (3,), 92)})
    meta = {"rank": "3", "run_id": "r\u00e9"}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    with open(ours, "wb") as f:
        size = write_safetensors(f, tensors, meta)
    save_file(tensors, theirs, metadata=meta)
    assert size == ours.stat().st_size
    got, got_meta = _read(ours)
    want, want_meta = _read(theirs)
    assert got_meta == want_meta == meta
    assert sorted(got) == sorted(want) == sorted(tensors)
    for key, t in tensors.items():
        assert got[key].dtype == want[key].dtype == t.dtype, key
        assert got[key].shape == want[key].shape == t.shape, key
        assert torch.equal(_bits(got[key]), _bits(t)), key


def test_layout_is_aligned_contiguous_and_largest_elements_first():
    buf = io.BytesIO()
    tensors = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.arange(5), "c": torch.zeros(0),
               "d": torch.ones(1, dtype=torch.float8_e4m3fn), "e": torch.full((2,), 7, dtype=torch.int16)}
    n = write_safetensors(buf, tensors, {})
    data = buf.getvalue()
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    offsets = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
    assert list(offsets) == ["b", "c", "a", "e", "d"]  # 8-, 4-, 2-, 2-, 1-byte elements
    assert offsets == {"b": [0, 40], "c": [40, 40], "a": [40, 46], "e": [46, 50], "d": [50, 51]}
    assert header_len % 8 == 0 and n == len(data) == 8 + header_len + 51
    start = 8 + header_len
    assert data[start + 40:start + 46] == bytes(_bits(tensors["a"]).tolist())


@pytest.mark.parametrize("bad, match", [
    (torch.ones(4, 4).t(), "contiguous CPU"),
    (torch.ones(2, dtype=torch.complex128), "no dtype for torch.complex128"),
])
def test_bad_tensor_is_named_before_anything_is_written(bad, match):
    buf = io.BytesIO()
    with pytest.raises(ValueError, match=f"tensor 'layer.x'.*{match}"):
        write_safetensors(buf, {"ok": torch.ones(2), "layer.x": bad}, {})
    assert buf.getvalue() == b""
