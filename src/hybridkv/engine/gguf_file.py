"""A fast GGUF reader: header and metadata with ``struct``, tensors as views of one ``mmap``.

About 0.2 s for Gemma 3's header where ``gguf.GGUFReader`` takes about 9 s; tensor data is never
copied until it is dequantized. See docs/ENGINE.md, "The GGUF reader".
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridkv.errors import InvalidInputError

# GGUF metadata value types: id -> (struct format, numpy dtype) for the fixed-size scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
    5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "<u1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9


_Q8_0 = 8


def _dequantize_q8_0(raw: np.ndarray) -> torch.Tensor:
    """Q8_0 blocks (an fp16 scale, then 32 int8 values) to float32.

    ``gguf.quants`` takes ~4.5 s for Gemma's 168M-value embedding; one torch multiply into a
    preallocated output takes ~1 s (most of it first-touching the 670 MB result).
    """
    blocks = raw.reshape(-1, 34)
    scale = torch.from_numpy(blocks[:, :2].copy().view(np.float16)).float()
    values = torch.from_numpy(np.array(blocks[:, 2:]).view(np.int8))  # a writable copy of the int8 part
    out = torch.empty(values.shape, dtype=torch.float32)
    return torch.mul(values, scale, out=out)


class GGUFError(InvalidInputError):
    """The file is not a GGUF file this reader understands (the message says what is wrong)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    qtype: int
    """``gguf.GGMLQuantizationType`` value."""
    shape: tuple[int, ...]
    """numpy order (outermost first): the reverse of GGUF's ``ne``."""
    data: np.ndarray
    """The raw bytes (uint8 view into the mapped file)."""


class GGUFFile:
    """Metadata (``dict``) and tensors (``dict`` of ``GGUFTensor``) of one GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise GGUFError(f"cannot map {self.path}: {exc}") from exc
        self._buf = memoryview(self._mm)
        self._pos = 0
        try:
            self.metadata, self.tensors = self._parse()
        except struct.error as exc:
            raise GGUFError(f"{self.path}: truncated GGUF header ({exc})") from exc

    # ------------------------------------------------------------------ parsing
    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._read("<Q")
        raw = bytes(self._buf[self._pos:self._pos + n])
        if len(raw) != n:
            raise GGUFError(f"{self.path}: truncated string at byte {self._pos}")
        self._pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            value = self._read(_SCALARS[vtype][0])
            return bool(value) if vtype == 7 else value
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            itype, count = self._read("<I"), self._read("<Q")
            if itype in _SCALARS:  # a fixed-size array: one numpy view instead of a Python loop
                dtype = np.dtype(_SCALARS[itype][1])
                arr = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos)
                self._pos += count * dtype.itemsize
                return arr.astype(bool) if itype == 7 else arr
            return [self._value(itype) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} at byte {self._pos}")

    def _parse(self) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
        if bytes(self._buf[:4]) != b"GGUF":
            raise GGUFError(f"{self.path} is not a GGUF file (magic {bytes(self._buf[:4])!r})")
        self._pos = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            metadata[key] = self._value(self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._read("<I")
            ne = [self._read("<Q") for _ in range(n_dims)]
            infos.append((name, ne, self._read("<I"), self._read("<Q")))
        align = int(metadata.get("general.alignment", 32))
        start = (self._pos + align - 1) // align * align
        return metadata, {name: self._tensor(name, ne, qtype, start + off) for name, ne, qtype, off in infos}

    def _tensor(self, name: str, ne: list[int], qtype: int, offset: int) -> GGUFTensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError) as exc:
            raise GGUFError(f"{self.path}: tensor {name!r} has unknown type {qtype}") from exc
        count = int(np.prod(ne)) if ne else 1
        nbytes = count // block * type_size
        if offset + nbytes > len(self._buf):
            raise GGUFError(f"{self.path}: tensor {name!r} runs past the end of the file")
        data = np.frombuffer(self._buf, dtype=np.uint8, count=nbytes, offset=offset)
        return GGUFTensor(name, qtype, tuple(reversed(ne)), data)

    # ------------------------------------------------------------------ access
    def dequantize(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a float32 torch tensor, outermost dimension first."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.path} has no tensor {name!r}")
        if t.qtype == _Q8_0:
            out = _dequantize_q8_0(t.data)
        else:  # gguf.quants expects the raw rows shaped (..., bytes per row)
            rows = t.data.reshape(*t.shape[:-1], -1) if len(t.shape) > 1 else t.data
            arr = np.asarray(dequantize(rows, GGMLQuantizationType(t.qtype)), dtype=np.float32)
            out = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        return out.reshape(t.shape)

    def close(self) -> None:
        self._buf.release()
        self._mm.close()
