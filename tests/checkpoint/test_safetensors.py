"""Our safetensors reader/writer interoperates with the reference `safetensors` library,
including bfloat16 (how real checkpoints ship), which NumPy alone cannot represent."""

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file as torch_load
from safetensors.torch import save_file as torch_save

from dlm_jax import CheckpointError
from dlm_jax.checkpoint import load_file, read_header, save_file

DTYPES = [(np.float32, torch.float32), (np.float16, torch.float16),
          (ml_dtypes.bfloat16, torch.bfloat16), (np.int64, torch.int64), (np.bool_, torch.bool)]


@pytest.mark.parametrize("np_dtype, torch_dtype", DTYPES)
def test_reference_library_reads_what_we_write(tmp_path, np_dtype, torch_dtype):
    values = np.random.default_rng(0).normal(size=(3, 5)) * 4
    ours = {"a.weight": values.astype(np_dtype), "b": values[0].astype(np_dtype)}
    save_file(ours, tmp_path / "x.safetensors")
    ref = torch_load(str(tmp_path / "x.safetensors"))
    for name, arr in ours.items():
        assert ref[name].dtype == torch_dtype
        np.testing.assert_array_equal(ref[name].float().numpy(), arr.astype(np.float32))


@pytest.mark.parametrize("np_dtype, torch_dtype", DTYPES)
def test_we_read_what_the_reference_library_writes(tmp_path, np_dtype, torch_dtype):
    t = (torch.randn(4, 6) * 4).to(torch_dtype)
    torch_save({"w": t, "empty": torch.zeros(0, 3, dtype=torch_dtype)}, str(tmp_path / "x.safetensors"))
    ours = load_file(tmp_path / "x.safetensors")
    assert ours["w"].dtype == np.dtype(np_dtype) and ours["empty"].shape == (0, 3)
    np.testing.assert_array_equal(ours["w"].astype(np.float32), t.float().numpy())


def test_offsets_that_disagree_with_the_shape_are_rejected(tmp_path):
    import json
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}).encode()
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(CheckpointError, match="tensor 'w' spans 12 bytes but shape"):
        read_header(tmp_path / "bad.safetensors")
