"""The ``vllm serve`` line of docs/engines.md and docs/gateway.md, read by vLLM itself: its
``serve`` argument parser turns ``--kv-transfer-config`` into a ``KVTransferConfig``, vLLM's
connector factory resolves the class it names to ``TenantKVConnector``, and the connector's
settings parser reads the extra config (``config_file``: docs/deploy.md's example file, its
key paths pointed at keys made here) into a verifier for the audience the gateway signs for.
Nothing is served: the parse is what ``vllm serve`` does first."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tenantkv.tenant_assertion import AssertionSigner, TenantAssertionError, public_key_pem
from tests.doc_recipes import deploy_example, kv_transfer_config, vllm_serve_args


def _serve_parser() -> object:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    root = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(root.add_subparsers(dest="subcommand"))
    return root


def test_vllm_parses_the_documented_serve_line_into_the_tenantkv_connector() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from tenantkv.integrations.vllm import TenantKVConnector

    args = vllm_serve_args("engines.md")
    assert vllm_serve_args("gateway.md") == args
    # (AsyncEngineArgs.from_cli_args would next resolve the model: a download, not a parse)
    parsed = _serve_parser().parse_args(["serve", *args])  # type: ignore[attr-defined]
    config = parsed.kv_transfer_config
    assert isinstance(config, KVTransferConfig)
    assert config.kv_role == "kv_both" and config.kv_load_failure_policy == "recompute"
    assert config.kv_connector_extra_config == kv_transfer_config(args)["kv_connector_extra_config"]
    assert KVConnectorFactory.get_connector_class(config) is TenantKVConnector
    assert parsed.disable_hybrid_kv_cache_manager is True
    assert parsed.enable_prompt_tokens_details is True
    # control: a misspelt class name is refused by the same factory
    wrong = KVTransferConfig(**{**kv_transfer_config(args), "kv_connector": "TenantKVConector"})
    with pytest.raises(AttributeError):
        KVConnectorFactory.get_connector_class(wrong)


def test_the_connector_reads_the_documented_extra_config(tmp_path: Path) -> None:
    from tenantkv.integrations.vllm.settings import ConnectorSettings

    extra = kv_transfer_config(vllm_serve_args("engines.md"))["kv_connector_extra_config"]
    text, tables = deploy_example()
    assert text.startswith(f"# {extra['config_file']}\n")  # the file the example is
    signing = Ed25519PrivateKey.generate()
    (documented_pem,) = tables["vllm"]["gateway_public_keys"]
    pem = tmp_path / "gateway.pub.pem"
    pem.write_bytes(public_key_pem(signing.public_key()))
    path = tmp_path / "tenantkv.toml"
    path.write_text(text.replace(documented_pem, str(pem)), encoding="utf-8")

    settings = ConnectorSettings.from_extra_config({**extra, "config_file": str(path)}, "m")
    assert settings.root == tables["cache"]["root"]
    assert settings.open_options["database_url"] == tables["cache"]["database_url"]
    assert settings.audience == tables["gateway"]["audience"]  # what the gateway signs for
    assert settings.require_incarnation is tables["vllm"]["require_incarnation"]
    verifier = settings.verifier()
    signer = AssertionSigner(signing)
    aud = tables["gateway"]["audience"]
    claims = verifier.verify(signer.sign("acme", audience=aud, ttl=60, incarnation="00" * 16))
    assert claims.tenant == "acme"
    with pytest.raises(TenantAssertionError):  # control: another deployment's assertion
        verifier.verify(signer.sign("acme", audience="other", ttl=60, incarnation="00" * 16))
