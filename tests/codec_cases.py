"""What the codec tests share (tests/test_codec_kernels.py, tests/test_codec_encoders.py): the
layouts and dtypes they code, and the fixture that runs each test once through the C kernels
and once through the torch path (the one CUDA tensors and installs without a compiler take):
``codec_path``, imported by a test module, gives its tests the fixture ``path``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tenantkv.codecs as codecs_module
from tenantkv import KVLayout

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LAYOUTS = {
    # MLA: a latent of 64 (two int4 groups of 32, the rotation block), k_rot of 16 in fp8
    "mla": KVLayout.mla(num_layers=1, kv_lora_rank=64, rope_dim=16, dtype=torch.bfloat16),
    # MLA with a latent of 32 and an odd-sized k_rot (fp8 codes any width)
    "mla-small": KVLayout.mla(num_layers=1, kv_lora_rank=32, rope_dim=7, dtype=torch.bfloat16),
    # MHA, head_dim 128: groups of 32, 8 per K row (more than one lane batch of the C decoder)
    "mha-128": KVLayout.mha(num_layers=1, num_kv_heads=5, head_dim=128, dtype=torch.bfloat16),
    # MHA, head_dim 80 (power-of-two factor 16) and 24 (factor 8): smaller groups
    "mha-80": KVLayout.mha(num_layers=1, num_kv_heads=2, head_dim=80, dtype=torch.bfloat16),
    "mha-24": KVLayout.mha(num_layers=1, num_kv_heads=3, head_dim=24, dtype=torch.bfloat16),
}


def coded(name: str, kind: str, dtype: torch.dtype) -> KVLayout:
    """``LAYOUTS[kind]`` in ``dtype`` under codec ``name``."""
    return dataclasses.replace(LAYOUTS[kind], dtype=dtype).with_codec(name)


@pytest.fixture(params=["c", "torch"], name="path")
def codec_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test once through the C kernels and once through the torch path."""
    if request.param == "c":
        if codecs_module.kernels is None:
            pytest.skip("tenantkv was installed without a C compiler")
    else:
        monkeypatch.setattr(codecs_module, "kernels", None)
    return str(request.param)
