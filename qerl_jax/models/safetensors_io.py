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

from qerl_jax.infra.atomic_io import remove_quietly, storage_errors
from qerl_jax.infra.errors import ConfigError

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


class SafetensorsError(ConfigError):
    """A .safetensors file that is not one, or whose header does not describe its bytes; the
    message names the file (and the tensor)."""


def _check_entry(path: str, name: str, entry, data_size: int) -> None:
    """SafetensorsError unless header entry `name` has a shape and a byte range inside the
    file's data that its shape and (known) dtype fill exactly."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise SafetensorsError(f"{path}: tensor {name!r}: corrupt header entry {entry!r:.80}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise SafetensorsError(f"{path}: tensor {name!r}: corrupt shape {shape!r:.80}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(n, int) for n in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise SafetensorsError(f"{path}: tensor {name!r}: corrupt data_offsets {offsets!r:.80}")
    begin, end = offsets
    dtype = DTYPES.get(entry["dtype"])   # an unknown one fails when that tensor is read
    expected = int(np.prod(shape, dtype=np.int64)) * (dtype.itemsize if dtype else 0)
    if dtype is not None and end - begin != expected:
        raise SafetensorsError(f"{path}: tensor {name!r} holds {end - begin} bytes, its shape "
                               f"{tuple(shape)} and dtype {entry['dtype']} need {expected}")
    if end > data_size:
        raise SafetensorsError(f"{path}: truncated: tensor {name!r} needs bytes {begin}..{end} "
                               f"of the data, the file holds {data_size}")


class SafetensorsFile:
    """A read-only view of one .safetensors file; `file[name]` is a numpy array view. Opening
    checks the whole header (every tensor's dtype, shape and byte range against the file's
    size), so a truncated or corrupt file fails here, naming the file and the tensor."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise SafetensorsError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            file_size = os.path.getsize(path)
            if header_len > file_size - 8:
                raise SafetensorsError(f"{path}: corrupt safetensors header length "
                                       f"{header_len} (the file has {file_size} bytes)")
            try:
                header = json.loads(handle.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise SafetensorsError(f"{path}: corrupt safetensors header: {error}") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: corrupt safetensors header: not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        for name, entry in header.items():
            _check_entry(path, name, entry, file_size - self._data_start)
        self._entries = header
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
            raise SafetensorsError(f"{self.path}: tensor {name!r} has unsupported dtype {code}")
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
            raise SafetensorsError(f"{self.path}: tensor {name!r} holds {end - begin} bytes, its "
                             f"shape {shape} and dtype need {expected}")
        raw = self._map[self._data_start + begin:self._data_start + end]
        return raw.view(dtype).reshape(shape)


def save_safetensors(path: str, tensors: Mapping[str, np.ndarray],
                     metadata: Mapping[str, str] | None = None) -> None:
    """Writes `tensors` (numpy arrays, written one at a time) to `path` atomically;
    StorageError naming `path` when it cannot be written."""
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
    try:
        with storage_errors(path):
            with open(temporary, "wb") as handle:
                handle.write(struct.pack("<Q", len(encoded)))
                handle.write(encoded)
                for array in arrays.values():
                    handle.write(np.ascontiguousarray(array).tobytes())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
    finally:
        remove_quietly(temporary)


def iterate_tensors(files: list[SafetensorsFile]) -> Iterator[tuple[str, SafetensorsFile]]:
    """(name, file) for every tensor of every file."""
    for file in files:
        for name in file.keys():
            yield name, file
