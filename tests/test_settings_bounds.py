"""Numeric settings of the assertion verifier and signer, the cache config and the engine
connector are finite and bounded. A NaN compares false with everything, so ``x < 0`` style
checks let it through and every later comparison with it is false: a NaN ``max_lifetime`` once
switched the verifier's lifetime check off. Each property has its control: values in range are
accepted and take effect."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from tenantkv.config import MAX_SECONDS, CacheConfig
from tenantkv.errors import InvalidRequestError, TenantAssertionError
from tenantkv.server.settings import Settings
from tenantkv.tenant_assertion import (
    DEFAULT_MAX_LIFETIME,
    MAX_CLOCK_SKEW,
    MAX_LIFETIME_LIMIT,
    TOO_LONG_LIVED,
    AssertionSigner,
    AssertionVerifier,
    lifetime_setting,
)
from tests.helpers import ManualClock

NOW = 1_800_000_000.0
KEY = Ed25519PrivateKey.generate()
SETTINGS = settings(max_examples=60, deadline=None)

NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def out_of_range(
    maximum: float, *, minimum: float = 0.0, open_minimum: bool = True
) -> st.SearchStrategy[float]:
    """Non-finite values, values below the range (the minimum itself where it is excluded)
    and above it."""
    below = st.floats(max_value=minimum, exclude_max=not open_minimum, allow_nan=False)
    above = st.floats(min_value=maximum, exclude_min=True, allow_nan=False)
    return st.one_of(NON_FINITE, below, above)


def in_range(
    maximum: float, *, minimum: float = 0.0, open_minimum: bool = True
) -> st.SearchStrategy[float]:
    return st.floats(min_value=minimum, max_value=maximum, exclude_min=open_minimum)


def _verifier(**options: Any) -> AssertionVerifier:
    return AssertionVerifier([KEY.public_key()], clock=ManualClock(NOW), **options)


@SETTINGS
@given(value=out_of_range(MAX_LIFETIME_LIMIT, minimum=1.0, open_minimum=False))
def test_verifier_refuses_a_max_lifetime_out_of_range(value: float) -> None:
    with pytest.raises(InvalidRequestError, match="max_lifetime"):
        _verifier(max_lifetime=value)


@SETTINGS
@given(value=out_of_range(MAX_CLOCK_SKEW, open_minimum=False))
def test_verifier_refuses_a_clock_skew_out_of_range(value: float) -> None:
    with pytest.raises(InvalidRequestError, match="clock_skew"):
        _verifier(clock_skew=value)


@SETTINGS
@given(
    lifetime=in_range(MAX_LIFETIME_LIMIT, minimum=1.0, open_minimum=False),
    skew=in_range(MAX_CLOCK_SKEW, open_minimum=False),
)
def test_verifier_takes_settings_in_range_and_enforces_them(lifetime: float, skew: float) -> None:
    """Control: accepted, and the configured lifetime is the one enforced."""
    verifier = _verifier(max_lifetime=lifetime, clock_skew=skew)
    signer = AssertionSigner(KEY, clock=ManualClock(NOW))
    longest = math.floor(lifetime)
    assert verifier.verify(signer.sign("acme", ttl=longest)).tenant == "acme"
    if longest + 1 <= MAX_LIFETIME_LIMIT:
        with pytest.raises(TenantAssertionError) as caught:
            verifier.verify(signer.sign("acme", ttl=longest + 1))
        assert caught.value.reason == TOO_LONG_LIVED


@SETTINGS
@given(value=st.one_of(out_of_range(MAX_LIFETIME_LIMIT), st.booleans()))
def test_signer_refuses_a_ttl_out_of_range(value: float) -> None:
    signer = AssertionSigner(KEY, clock=ManualClock(NOW))
    with pytest.raises(InvalidRequestError, match="ttl"):
        signer.sign("acme", ttl=value)


DURATIONS = ("lease_seconds", "gc_interval")
GRACES = ("orphan_grace", "scrub_timeout")


@SETTINGS
@given(
    name=st.sampled_from(DURATIONS + GRACES + ("hit_cost",)),
    data=st.data(),
)
def test_cache_config_refuses_numbers_out_of_range(name: str, data: st.DataObject) -> None:
    maximum = 1.0 if name == "hit_cost" else MAX_SECONDS
    value = data.draw(out_of_range(maximum, open_minimum=name not in GRACES))
    with pytest.raises(InvalidRequestError, match=name):
        CacheConfig(root=Path("/nonexistent"), **{name: value})


@SETTINGS
@given(
    name=st.sampled_from(DURATIONS + GRACES + ("hit_cost",)),
    data=st.data(),
)
def test_cache_config_takes_numbers_in_range(name: str, data: st.DataObject) -> None:
    maximum = 1.0 if name == "hit_cost" else MAX_SECONDS
    value = data.draw(in_range(maximum, open_minimum=name not in GRACES))
    assert getattr(CacheConfig(root=Path("/nonexistent"), **{name: value}), name) == value


@pytest.mark.parametrize("raw", ["nan", "inf", "-1", "0"])
def test_cache_config_from_the_environment_refuses_non_finite_numbers(
    raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENANTKV_LEASE_SECONDS", raw)
    with pytest.raises(InvalidRequestError, match="lease_seconds"):
        CacheConfig.from_env(root=Path("/nonexistent"))
    monkeypatch.setenv("TENANTKV_LEASE_SECONDS", "30")  # control
    assert CacheConfig.from_env(root=Path("/nonexistent")).lease_seconds == 30


@SETTINGS
@given(
    value=st.one_of(
        out_of_range(MAX_LIFETIME_LIMIT, minimum=1.0, open_minimum=False),
        st.sampled_from(["nan", "inf", "-5", "0.5", "soon", True]),
    )
)
def test_engines_refuse_a_max_assertion_lifetime_out_of_range(value: Any) -> None:
    """What the vLLM connector and the SGLang backend parse ``max_assertion_lifetime`` with
    (their own tests, in tests_engines/, need the engines)."""
    with pytest.raises(InvalidRequestError, match="max_assertion_lifetime"):
        lifetime_setting("max_assertion_lifetime", value)


def test_engines_take_a_max_assertion_lifetime_in_range() -> None:
    """Control: in range, as a number or its text, and unset (the default)."""
    for value, expected in ((120, 120.0), ("90.5", 90.5), (None, DEFAULT_MAX_LIFETIME)):
        assert lifetime_setting("max_assertion_lifetime", value) == expected


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 0.0, 367 * 86400.0])
def test_admin_service_refuses_a_default_token_ttl_out_of_range(value: float) -> None:
    """An infinite default was taken, then refused at every token creation."""
    with pytest.raises(ValueError, match="default_token_ttl_seconds"):
        Settings(root="/nonexistent", default_token_ttl_seconds=value)
    assert Settings(root="/nonexistent", default_token_ttl_seconds=3600).default_token_ttl_seconds
