"""Minimal safetensors reader/writer over numpy memory maps (bf16 and fp8 via ml_dtypes).

The `safetensors` numpy backend cannot read bfloat16, so this module parses the (simple,
documented) format itself: 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}}, then the raw little-endian tensor bytes. Reading memory-maps
the file and returns one tensor at a time, so loading never holds a second full copy of a
checkpoint in host memory. Writing is atomic (temporary file + rename).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32), "U64": np.dtype(np.uint64), "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsFile:
    """A read-only view of one .safetensors file; `file[name]` is a numpy array view."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            file_size = os.path.getsize(path)
            if header_len > file_size - 8:
                raise ValueError(f"{path}: corrupt safetensors header length {header_len}")
            try:
                header = json.loads(handle.read(header_len))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: corrupt safetensors header: {error}") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._entries = header
        self._data_start = 8 + header_len
        self._map = np.memmap(path, dtype=np.uint8, mode="r") if file_size > 0 else None

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return self._dtype(name)

    def _dtype(self, name: str) -> np.dtype:
        code = self._entries[name]["dtype"]
        if code not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {code}")
        return DTYPES[code]

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._entries:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        entry = self._entries[name]
        begin, end = entry["data_offsets"]
        dtype = self._dtype(name)
        shape = tuple(entry["shape"])
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != expected:
            raise ValueError(f"{self.path}: tensor {name!r} holds {end - begin} bytes, its "
                             f"shape {shape} and dtype need {expected}")
        raw = self._map[self._data_start + begin:self._data_start + end]
        return raw.view(dtype).reshape(shape)


def save_safetensors(path: str, tensors: Mapping[str, np.ndarray],
                     metadata: Mapping[str, str] | None = None) -> None:
    """Writes `tensors` (numpy arrays, written one at a time) to `path` atomically."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    arrays = {}
    for name, array in tensors.items():
        array = np.asarray(array)
        if array.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {array.dtype} cannot be saved")
        nbytes = array.size * array.dtype.itemsize
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + nbytes]}
        arrays[name] = array
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for array in arrays.values():
            handle.write(np.ascontiguousarray(array).tobytes())
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def iterate_tensors(files: list[SafetensorsFile]) -> Iterator[tuple[str, SafetensorsFile]]:
    """(name, file) for every tensor of every file."""
    for file in files:
        for name in file.keys():
            yield name, file
