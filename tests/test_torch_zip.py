"""pytorch_model.bin read without PyTorch (specjax/torch_zip.py): every tensor as torch saved it (dtypes, views with
offsets and strides, scalars), and a file holding anything but tensors refused without running it."""

import collections
import os

import numpy as np
import pytest
import torch

from specjax import torch_zip


def test_state_dicts_read_as_torch_wrote_them(tmp_path):
    base = torch.randn(10)
    sd = collections.OrderedDict(
        w=torch.randn(3, 4), transposed=torch.randn(4, 3).t(), ids=torch.arange(5, dtype=torch.int64),
        bf16=torch.randn(2, 2).to(torch.bfloat16), half_slice=torch.randn(6).to(torch.float16)[2:5],
        scalar=torch.tensor(3.5), mask=torch.tensor([True, False]), strided=base[::2], shared=base[1:4])
    torch.save(sd, str(tmp_path / "pytorch_model.bin"))
    got = torch_zip.load(str(tmp_path / "pytorch_model.bin"))
    assert list(got) == list(sd)
    for k, v in sd.items():
        want = v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy()
        assert got[k].shape == want.shape and str(got[k].dtype) == str(v.dtype).removeprefix("torch."), k
        np.testing.assert_array_equal(np.asarray(got[k], np.float32 if v.dtype == torch.bfloat16 else None), want)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch should-not-exist",))


def test_anything_but_tensors_is_refused_unrun(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"w": torch.ones(2), "x": _RunsCode()}, str(tmp_path / "evil.bin"))
    with pytest.raises(torch_zip.TorchFileError, match="not only tensors: refused"):
        torch_zip.load(str(tmp_path / "evil.bin"))
    assert not (tmp_path / "should-not-exist").exists()
    (tmp_path / "old.bin").write_bytes(b"\x80\x02not a zip")
    with pytest.raises(torch_zip.TorchFileError, match="not a PyTorch zip checkpoint"):
        torch_zip.load(str(tmp_path / "old.bin"))


class _Storage:
    pass


def _crafted(path, size, stride, offset=0, nbytes=16):
    """A zip checkpoint whose one tensor claims ``size`` / ``stride`` / ``offset`` over a storage of ``nbytes``."""
    import io
    import pickle
    import zipfile

    class View:
        def __reduce__(self):
            return (torch._utils._rebuild_tensor_v2, (_Storage(), offset, size, stride, False,
                                                      collections.OrderedDict()))

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", nbytes // 4) if isinstance(obj, _Storage) else None
    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump({"w": View()})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/data/0", b"\0" * nbytes)
    return str(path)


@pytest.mark.parametrize("size, stride, offset, nbytes, message", [
    ((64,), (1,), 0, 16, "reaches past its storage of 4 elements"),  # would read 240 bytes of the heap
    ((1 << 26,), (1 << 10,), 0, 16, "reaches past its storage"),  # would crash the process
    ((2,), (1,), 3, 16, "reaches past its storage"),
    ((2,), (-1,), 1, 16, "a tensor of size"),
    ((1,), (1,), 0, 10, "not whole float32"),
])
def test_views_outside_their_storage_are_refused(tmp_path, size, stride, offset, nbytes, message):
    with pytest.raises(torch_zip.TorchFileError, match=message):
        torch_zip.load(_crafted(tmp_path / "crafted.bin", size, stride, offset, nbytes))
    assert torch_zip.load(_crafted(tmp_path / "ok.bin", (2, 2), (1, 2)))["w"].shape == (2, 2)


def test_parameters_read_as_their_data(tmp_path):
    """A state dict of nn.Parameter objects (torch.save(dict(model.named_parameters()))), as weights_only reads it."""
    w = torch.nn.Parameter(torch.randn(3, 2))
    torch.save({"w": w}, str(tmp_path / "p.bin"))
    np.testing.assert_array_equal(torch_zip.load(str(tmp_path / "p.bin"))["w"], w.detach().numpy())


def test_damaged_files_are_named_not_tracebacks(tmp_path):
    """A flipped byte in a tensor's record (its CRC fails), a file cut short and an empty file are each a
    TorchFileError naming the file (the CRC failure was a bare zipfile.BadZipFile; a truncated file was called "not a
    PyTorch zip checkpoint (since PyTorch 1.6)")."""
    w = torch.arange(1000, 1064, dtype=torch.float32)
    torch.save({"w": w}, str(tmp_path / "good.bin"))
    data = (tmp_path / "good.bin").read_bytes()
    at = data.index(w.numpy().tobytes())
    (tmp_path / "flipped.bin").write_bytes(data[:at + 9] + bytes([data[at + 9] ^ 0xFF]) + data[at + 10:])
    (tmp_path / "cut.bin").write_bytes(data[:len(data) // 2])
    (tmp_path / "empty.bin").write_bytes(b"")
    for name, message in (("flipped", "is damaged .BadZipFile: Bad CRC-32"), ("cut", "is truncated or damaged"),
                          ("empty", "is empty")):
        path = str(tmp_path / f"{name}.bin")
        with pytest.raises(torch_zip.TorchFileError, match=f"^{path} {message}"):
            torch_zip.load(path)
