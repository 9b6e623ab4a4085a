"""Fixtures of the engine tests (run by scripts/test_engines.sh in .venv-engines).

The index backends come from the main suite's conftest (``index``: SQLite and PostgreSQL), so
every test that opens a cache runs on both. The model is a tiny random Llama written at test
time (head_dim 64: vLLM's CPU backend refuses 16); nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tenantkv.tenant_assertion import AssertionSigner, public_key_pem
from tests.conftest import (  # noqa: F401  (fixtures and hooks shared with the main suite)
    _default_index_needs_the_index_fixture,
    index,
    postgres_schemas,
    pytest_addoption,
    pytest_generate_tests,
)
from tests_engines.hosted import (  # noqa: F401  (the one vllm serve of the session; BLOCK)
    BLOCK,
    hosted_stack,
)

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def write_tiny_llama(directory: Path, *, seed: int = 0) -> Path:
    """A randomly initialised 2-layer Llama (GQA: 4 query heads, 2 KV heads of 64)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def write_tiny_deepseek(directory: Path, *, seed: int = 0) -> Path:
    """A randomly initialised 2-layer DeepSeek-V2 (MLA: kv_lora_rank 512, rope 64; dense MLPs).

    vLLM's CPU build runs it with its CPU_MLA backend, which forces 16-token blocks."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
        max_position_embeddings=1024,
        torch_dtype="float32",
    )
    DeepseekV2ForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_deepseek(tmp_path_factory.mktemp("tiny-deepseek"))


@pytest.fixture(scope="session")
def gateway_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture(scope="session")
def gateway(gateway_key: Ed25519PrivateKey) -> AssertionSigner:
    return AssertionSigner(gateway_key)


@pytest.fixture(scope="session")
def gateway_pem(gateway: AssertionSigner) -> str:
    return public_key_pem(gateway.public_key).decode("ascii")


@pytest.fixture
def no_leftover_caches() -> Iterator[None]:
    """Close the connector's process-wide caches after a test (they are keyed by root)."""
    yield
    from tenantkv.integrations.engine_cache import close_caches

    close_caches()
