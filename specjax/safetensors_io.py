"""Minimal, lazy safetensors reader/writer on numpy memory maps (bf16 via ml_dtypes).

Reading through a memmap lets the loader slice exactly the part of a tensor that one device needs, so a sharded
7B checkpoint never sits whole in host memory. Writing is used by head export and GGUF conversion.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsError(ValueError):
    pass


class SafetensorsFile:
    """One .safetensors file; ``tensor(name)`` returns a read-only memmap view (no copy). The header is checked
    when the file opens (every entry's dtype, shape and byte range), so that a damaged or hand-edited file is a
    SafetensorsError naming the file and the tensor, never a KeyError or a reshape error later."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise SafetensorsError(f"{path}: truncated file (no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise SafetensorsError(f"{path}: header length {n} exceeds file size {size}")
            try:
                header = json.loads(f.read(n).decode("utf-8"))
            except UnicodeDecodeError as e:
                raise SafetensorsError(f"{path}: corrupt header: not UTF-8 text ({e.reason} at byte "
                                       f"{8 + e.start})") from None
            except json.JSONDecodeError as e:
                raise SafetensorsError(f"{path}: corrupt header: {e}") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: corrupt header: a JSON {type(header).__name__}, not an object of "
                                   f"tensor entries")
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            raise SafetensorsError(f"{path}: corrupt header: __metadata__ is not an object")
        self.header = header
        self._base = 8 + n
        for name, info in header.items():
            _check_entry(path, name, info, size - self._base)
        self._mm = None

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(_DTYPES[self.header[name]["dtype"]])

    def tensor(self, name: str) -> np.ndarray:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        info = self.header[name]
        start, end = info["data_offsets"]
        buf = self._mm[self._base + start: self._base + end]
        return buf.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def _check_entry(path: str, name: str, info, data_size: int) -> None:
    """One header entry: a known dtype, a shape of non-negative ints, and ``data_offsets`` [begin, end] inside the
    file's ``data_size`` bytes holding exactly the shape's elements."""
    def bad(what: str):
        return SafetensorsError(f"{path}: tensor {name!r} {what} (a damaged or hand-edited file?)")
    if not isinstance(info, dict):
        raise bad(f"has a header entry {info!r}, not an object with dtype, shape and data_offsets")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise bad(f"has no {' or '.join(missing)} in the header")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {dtype}")
    is_count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0
    if not isinstance(shape, list) or not all(is_count(d) for d in shape):
        raise bad(f"has shape {shape!r}, not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_count(o) for o in offsets) \
            or offsets[0] > offsets[1]:
        raise bad(f"has data_offsets {offsets!r}, not [begin, end]")
    if offsets[1] > data_size:
        raise SafetensorsError(f"{path}: tensor {name} extends past the end of the file (truncated?)")
    want = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize
    if offsets[1] - offsets[0] != want:
        raise bad(f"holds {offsets[1] - offsets[0]} bytes, but {dtype} of shape {tuple(shape)} is {want} bytes")


class CheckpointIndex:
    """All tensors of a checkpoint folder: one ``model.safetensors`` or shards listed in
    ``*.safetensors.index.json``."""

    def __init__(self, folder: str):
        self.folder = folder
        index_files = [f for f in os.listdir(folder) if f.endswith(".safetensors.index.json")]
        files: list[str]
        if index_files:
            files = _index_files(os.path.join(folder, index_files[0]))
        else:
            files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not files:
            raise SafetensorsError(f"no .safetensors files in {folder}")
        self.files = {}
        self.where: dict[str, SafetensorsFile] = {}
        for fn in files:
            p = os.path.join(folder, fn)
            if not os.path.exists(p):
                raise SafetensorsError(f"{folder}: shard {fn} listed in the index is missing")
            sf = SafetensorsFile(p)
            self.files[fn] = sf
            for k in sf.keys():
                self.where[k] = sf

    def keys(self) -> list[str]:
        return list(self.where)

    def __contains__(self, k: str) -> bool:
        return k in self.where

    def shape(self, k: str) -> tuple[int, ...]:
        return self.where[k].shape(k)

    def dtype(self, k: str) -> np.dtype:
        return self.where[k].dtype(k)

    def tensor(self, k: str) -> np.ndarray:
        return self.where[k].tensor(k)


def _index_files(path: str) -> list[str]:
    """The shard files a ``*.safetensors.index.json`` lists (its ``weight_map`` of tensor -> file)."""
    with open(path) as f:
        try:
            files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise SafetensorsError(f"{path}: not a safetensors index (a JSON object whose weight_map maps each "
                                   f"tensor to its file)") from None
    if not all(isinstance(fn, str) for fn in files):
        raise SafetensorsError(f"{path}: the weight_map names files that are not strings")
    return files


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write tensors (numpy, ml_dtypes.bfloat16 allowed) as one safetensors file, atomically."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for name in tensors:
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NAMES:
            raise SafetensorsError(f"cannot store dtype {a.dtype} of {name}")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, path)


def load_file(path: str, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    sf = SafetensorsFile(path)
    return {k: np.array(sf.tensor(k)) for k in (names if names is not None else sf.keys())}
