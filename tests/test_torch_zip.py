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
