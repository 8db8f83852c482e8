"""The safetensors reader against the `safetensors` package's own files: every tensor reads
back, and a truncated or corrupt file is one error naming the file and the tensor when it is
opened (not a reshape failure when the tensor is read)."""

import json
import os
import re
import struct

import numpy as np
import pytest

from qerl_jax.infra.errors import ConfigError, StorageError
from qerl_jax.models import safetensors_io
from qerl_jax.models.safetensors_io import SafetensorsError, SafetensorsFile, save_safetensors

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def _tensors(rng):
    return {"a.weight": rng.standard_normal((128, 256)).astype(np.float32),
            "b.bias": rng.integers(-9, 9, (7,)).astype(np.int32)}


def test_reads_what_the_safetensors_package_writes(tmp_path):
    tensors = _tensors(np.random.default_rng(0))
    path = str(tmp_path / "model.safetensors")
    safetensors_numpy.save_file(tensors, path)
    file = SafetensorsFile(path)
    assert sorted(file.keys()) == sorted(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(file[name], value)


def test_a_truncated_file_names_the_file_and_the_tensor(tmp_path):
    path = str(tmp_path / "model.safetensors")
    safetensors_numpy.save_file(_tensors(np.random.default_rng(1)), path)
    with open(path, "rb") as handle:
        (header_length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_length))
    os.truncate(path, os.path.getsize(path) - 100)
    data = os.path.getsize(path) - 8 - header_length
    cut = next(name for name, entry in header.items()   # the first one past the end
               if name != "__metadata__" and entry["data_offsets"][1] > data)
    with pytest.raises(SafetensorsError) as error:
        SafetensorsFile(path)
    begin, end = header[cut]["data_offsets"]
    assert str(error.value) == (f"{path}: truncated: tensor {cut!r} needs bytes {begin}..{end} "
                                f"of the data, the file holds {data}")
    assert isinstance(error.value, ConfigError)   # a bad input: one line, exit 2 in the CLI


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:8] + b"{not json" + data[17:], "corrupt safetensors header: "),
    (lambda data: struct.pack("<Q", 1 << 40) + data[8:], "corrupt safetensors header length"),
    (lambda data: data[:4], "not a safetensors file (shorter than 8 bytes)"),
])
def test_a_corrupt_header_names_the_file(tmp_path, damage, message):
    path = str(tmp_path / "model.safetensors")
    save_safetensors(path, _tensors(np.random.default_rng(2)))
    with open(path, "rb") as handle:
        data = handle.read()
    with open(path, "wb") as handle:
        handle.write(damage(data))
    with pytest.raises(SafetensorsError, match="^" + re.escape(f"{path}: {message}")):
        SafetensorsFile(path)


def test_a_wrong_byte_count_names_the_tensor(tmp_path):
    path = str(tmp_path / "model.safetensors")
    header = json.dumps({"x": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}})
    header = header.encode() + b" " * (-len(header) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    with pytest.raises(SafetensorsError, match=r"tensor 'x' holds 60 bytes, its shape \(4, 4\) "
                                               r"and dtype F32 need 64"):
        SafetensorsFile(path)


def test_a_failed_write_names_the_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = str(tmp_path / "model.safetensors")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors_io.os, "fsync", full_disk)
    with pytest.raises(StorageError, match=f"^could not write {path}: no space left on device$"):
        save_safetensors(path, _tensors(np.random.default_rng(3)))
    assert os.listdir(tmp_path) == []
