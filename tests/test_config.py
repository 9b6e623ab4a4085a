"""CacheConfig: defaults in one place, overrides, the environment, and refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

import tenantkv
import tenantkv.host_cpus
from tenantkv.config import CacheConfig, config_for_root, default_root

from .indexes import Index


def test_defaults_and_derived_locations(tmp_path: Path, index: Index) -> None:
    config = CacheConfig(root=tmp_path)
    assert config.index_url == index.url(tmp_path)  # sqlite:///<root>/index.db by default
    if index.is_sqlite:
        assert config.index_url == f"sqlite:///{tmp_path / 'index.db'}"
    assert config.blocks_url == (tmp_path / "blocks").resolve().as_uri()
    assert config.load_threads >= 2 and config.seal_threads >= 1
    assert config.staging_bytes == 128 * 2**20 and config.staging_slot_bytes == 16 * 2**20


def test_from_env_reads_prefixed_variables_and_overrides_win(tmp_path: Path) -> None:
    env = {
        "TENANTKV_ROOT": str(tmp_path),
        "TENANTKV_DATABASE_URL": "sqlite:///elsewhere.db",
        "TENANTKV_LOAD_WORKERS": "3",
        "TENANTKV_STRICT": "true",
        "TENANTKV_LEASE_SECONDS": "12.5",
        "UNRELATED": "x",
    }
    config = CacheConfig.from_env(env, seal_workers=5)
    assert config.root == tmp_path and config.database_url == "sqlite:///elsewhere.db"
    assert config.load_workers == 3 and config.strict is True and config.lease_seconds == 12.5
    assert config.seal_workers == 5
    assert CacheConfig.from_env({}) == CacheConfig()  # control: nothing set, all defaults


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"TENANTKV_LOAD_WORKERS": "many"}, "not a number"),
        ({"TENANTKV_STRICT": "perhaps"}, "not a boolean"),
        ({"TENANTKV_STAGING_BYTES": "0"}, "positive"),
        ({"TENANTKV_BLOCK_STORE_URL": "s3://bucket/kv"}, "block_store_url"),
        ({"TENANTKV_SUITE": "rot13"}, "suite"),
    ],
)
def test_bad_environment_is_refused_clearly(env: dict[str, str], match: str) -> None:
    with pytest.raises(tenantkv.InvalidRequestError, match=match):
        CacheConfig.from_env(env)


@pytest.mark.usefixtures("index")
def test_open_takes_a_config_with_overrides_and_refuses_unknown_settings(tmp_path: Path) -> None:
    blocks = tmp_path / "shared-mount"
    config = CacheConfig(root=tmp_path / "node", block_store_url=blocks.as_uri(), durable=False)
    with tenantkv.open(config, load_workers=3) as kv:
        assert kv.config.load_workers == 3 and kv.context.runtime.load_threads == 3
        assert kv.config.block_store_url == blocks.as_uri()
        kv.create_tenant("acme")
        assert kv.info()["root"] == str(tmp_path / "node")
    assert blocks.is_dir()
    with pytest.raises(tenantkv.InvalidRequestError, match="unknown cache settings: colour"):
        tenantkv.open(config, colour="blue")
    with pytest.raises(tenantkv.InvalidRequestError, match="staging slot"):
        tenantkv.open(config, staging_bytes=1024, staging_slot_bytes=4096)


def test_the_cli_and_the_server_share_one_default_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tenantkv.server.settings import Settings

    monkeypatch.delenv("TENANTKV_ROOT", raising=False)
    assert default_root() == "./tenantkv-data" == Settings().root
    monkeypatch.setenv("TENANTKV_ROOT", str(tmp_path))
    monkeypatch.setenv("TENANTKV_LOAD_WORKERS", "4")
    assert default_root() == str(tmp_path) == Settings().root
    assert Settings().cache_config() == config_for_root(tmp_path)
    assert Settings().cache_config().load_workers == 4


@pytest.mark.parametrize(
    ("cores", "seal", "load", "window"), [(6, 6, 6, 6), (1, 1, 2, 2), (32, 32, 32, 32)]
)
def test_worker_counts_and_window_follow_the_cpus_the_process_can_use(
    monkeypatch: pytest.MonkeyPatch, cores: int, seal: int, load: int, window: int
) -> None:
    # Not os.cpu_count(): the host's count inside a container or under taskset.
    monkeypatch.setattr(tenantkv.host_cpus, "usable_cpu_count", lambda: cores)
    config = CacheConfig()
    assert config.cores == cores
    assert (config.seal_threads, config.load_threads, config.read_ahead) == (seal, load, window)
    # Control: explicit settings win over the CPUs.
    explicit = CacheConfig(seal_workers=3, load_workers=5, window=7)
    assert (explicit.seal_threads, explicit.load_threads, explicit.read_ahead) == (3, 5, 7)


def test_cores_are_the_usable_cpus_of_this_process() -> None:
    assert CacheConfig().cores == tenantkv.host_cpus.usable_cpu_count()


@pytest.mark.parametrize("name", ["index_serving_timeout", "index_admin_timeout"])
@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "2", True])
def test_index_bounds_must_be_finite_and_positive(name: str, bad: object) -> None:
    """A bound that is zero, negative, infinite or NaN would leave a call unbounded or failing
    at once (NaN compares false with everything, so a sign check alone lets it through)."""
    with pytest.raises(tenantkv.InvalidRequestError, match=name):
        CacheConfig(**{name: bad})  # type: ignore[arg-type]
    assert getattr(CacheConfig(**{name: 0.5}), name) == 0.5  # control: a finite positive bound
    env = CacheConfig.from_env({"TENANTKV_" + name.upper(): "7.5"})
    assert getattr(env, name) == 7.5


def test_nan_is_refused_for_every_duration() -> None:
    for name in ("lease_seconds", "orphan_grace", "scrub_timeout", "gc_interval", "hit_cost"):
        with pytest.raises(tenantkv.InvalidRequestError, match=name):
            CacheConfig(**{name: float("nan")})  # type: ignore[arg-type]
        assert CacheConfig(**{name: 1.0}) is not None
