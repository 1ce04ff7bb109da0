"""PyTorch checkpoints (``pytorch_model.bin``, ``torch.save``'s zip format) read without PyTorch.

The official EAGLE and EAGLE3 heads ship their weights this way. The pickle inside is unpickled with a closed list
of globals (the tensor rebuild function, the storage types, ``OrderedDict``): anything else in the file (code, other
objects) is refused, as ``torch.load(weights_only=True)`` refuses it. Tensors come back as numpy arrays (bf16 as
``ml_dtypes.bfloat16``). The pre-1.6 non-zip format is refused with a message.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
import zlib

import ml_dtypes
import numpy as np

_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}


class TorchFileError(ValueError):
    """Not a PyTorch zip checkpoint of plain tensors."""


class _Storage:
    def __init__(self, dtype):
        self.dtype = dtype


def _rebuild_tensor(storage: np.ndarray, offset: int, size, stride, *_ignored) -> np.ndarray:
    """``torch._utils._rebuild_tensor_v2``'s arguments -> a numpy array (a copy, row-major). The view must lie
    inside its storage (a crafted file could point past it: read as memory, or crash the process)."""
    if not isinstance(storage, np.ndarray):
        raise TorchFileError("a tensor without a storage")
    size, stride = tuple(int(n) for n in size), tuple(int(n) for n in stride)
    offset = int(offset)
    if len(size) != len(stride) or min(size + stride + (offset,), default=0) < 0:
        raise TorchFileError(f"a tensor of size {size}, stride {stride}, offset {offset}")
    last = offset + sum((n - 1) * st for n, st in zip(size, stride))
    if 0 not in size and last >= len(storage):
        raise TorchFileError(f"a tensor of size {size}, stride {stride}, offset {offset} reaches past its storage "
                             f"of {len(storage)} elements")
    if not size:
        return np.array(storage[offset])
    item = storage.itemsize
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=size, strides=tuple(st * item for st in stride))
    return np.ascontiguousarray(view)


def _rebuild_parameter(data, *_ignored):
    """``torch._utils._rebuild_parameter``: an ``nn.Parameter`` is its data here."""
    return data


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, archive: zipfile.ZipFile, prefix: str):
        super().__init__(file)
        self.archive, self.prefix = archive, prefix

    def find_class(self, module: str, name: str):
        if (module, name) in (("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor")):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_parameter"):
            return _rebuild_parameter
        if module == "torch" and name in _STORAGE_DTYPES:
            return _Storage(_STORAGE_DTYPES[name])
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise TorchFileError(f"the file holds {module}.{name}, not only tensors: refused (it could run code)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise TorchFileError(f"unexpected persistent id {pid!r}")
        storage_type, key = pid[1], pid[2]
        if not isinstance(storage_type, _Storage):
            raise TorchFileError(f"unexpected storage type {storage_type!r}")
        raw = self.archive.read(f"{self.prefix}data/{key}")
        if len(raw) % np.dtype(storage_type.dtype).itemsize:
            raise TorchFileError(f"storage {key} holds {len(raw)} bytes, not whole {np.dtype(storage_type.dtype)}")
        return np.frombuffer(raw, dtype=storage_type.dtype)


def load(path: str) -> dict[str, np.ndarray]:
    """The tensors of a ``torch.save``d state dict (name -> numpy array)."""
    obj = load_object(path)
    if not isinstance(obj, dict) or not all(isinstance(v, np.ndarray) for v in obj.values()):
        raise TorchFileError(f"{path} is not a state dict of tensors")
    return dict(obj)


def load_object(path: str):
    """What ``torch.save`` wrote, made of tensors (numpy arrays), lists, dicts and numbers only. A file that is not
    such a checkpoint, or a damaged one (a zip record whose CRC fails, a truncated file), is a TorchFileError naming
    the file."""
    if not zipfile.is_zipfile(path):
        raise TorchFileError(f"{path} {_not_zip(path)}")
    try:
        with zipfile.ZipFile(path) as archive:
            pkl = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if len(pkl) != 1:
                raise TorchFileError(f"{path} holds {len(pkl)} data.pkl records, expected one")
            prefix = pkl[0][:-len("data.pkl")]
            with archive.open(pkl[0]) as f:
                return _Unpickler(f, archive, prefix).load()
    except TorchFileError as e:
        raise TorchFileError(e.args[0] if str(e).startswith(path) else f"{path}: {e}") from None
    except (zipfile.BadZipFile, zlib.error, NotImplementedError) as e:  # NotImplementedError: a compression method
        raise TorchFileError(f"{path} is damaged ({type(e).__name__}: {e}): download or save it again") from None
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise TorchFileError(f"{path} could not be read: {type(e).__name__}: {e}") from None


def _not_zip(path: str) -> str:
    """Why ``path``, not a zip file, is refused: what its first bytes say it is."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if not magic:
        return "is empty"
    if magic.startswith(b"PK"):
        return ("is truncated or damaged: it starts as a zip file (torch.save's format) but its zip directory, at "
                "the end of the file, is missing: download or save it again")
    if magic[:1] == b"\x80":
        return ("is not a PyTorch zip checkpoint (torch.save's format since PyTorch 1.6) but an older pickle: "
                "refused; save it again with a current PyTorch")
    return "is not a PyTorch checkpoint (torch.save's zip format): refused"
