"""The gateway's fast paths equal its slow ones: :func:`scrub.may_bear` never lets a removable
key through, and :class:`events.EventCleaner` sends exactly what the line-by-line rule sends,
for random JSON and random event streams cut at random places, with and without
identity-bearing keys (and with the spellings that only Unicode lowering or JSON escapes
reveal)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from tenantkv.gateway.events import EventCleaner
from tenantkv.gateway.scrub import identity_bearing, may_bear, scrub
from tenantkv.gateway.streaming import scrub_event_line

#: Key names that must be removed, in the spellings the rule knows: separators, case, the
#: Kelvin sign (lowered to "k").
BEARING = [
    "cache_salt",
    "Cache-Salt",
    "cacheSalt",
    "kv_transfer_params",
    "KV.Transfer",
    "\u212av_transfer_params",
    "vllm_xargs",
    "extra_args",
    "tenantkv_debug",
    "Tenant\u212aV",
    "x_tenantkv",
]
PLAIN_KEYS = ["id", "model", "choices", "text", "usage", "index", "cache", "salt", "kv", "args"]

keys = st.one_of(st.sampled_from(BEARING + PLAIN_KEYS), st.text(max_size=12))
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(max_size=20), st.sampled_from(BEARING)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)),
    max_leaves=20,
)
dumps_options = st.fixed_dictionaries(
    {
        "ensure_ascii": st.booleans(),
        "indent": st.sampled_from([None, 1]),
        "separators": st.sampled_from([None, (",", ":")]),
    }
)


def bearing_keys(value: Any) -> int:
    """The identity-bearing keys the scrub removes from ``value`` (one with all it holds),
    counted without the scrub's own walk."""
    if isinstance(value, dict):
        return sum(1 if identity_bearing(k) else bearing_keys(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(bearing_keys(v) for v in value)
    return 0


@given(json_values, dumps_options)
def test_may_bear_is_false_only_when_nothing_can_be_removed(
    value: Any, options: dict[str, Any]
) -> None:
    raw = json.dumps(value, **options).encode("utf-8")
    present = bearing_keys(value)
    if not may_bear(raw):
        assert present == 0
        assert scrub(json.loads(raw)) == 0
    if present:  # the positive control: a removable key is always looked at
        assert may_bear(raw)
        assert scrub(json.loads(raw)) == present


def test_may_bear_catches_spellings_the_bytes_hide() -> None:
    # escaped, Kelvin sign, separators, case: each is removed by the scrub, so each is parsed
    for raw in (
        b'{"cache\\u005fsalt": 1}',
        b'{"\\u0063ache_salt": 1}',
        '{"\u212av_transfer_params": 1}'.encode(),
        b'{"a": [{"b": {"Kv-Transfer-Params": {}}}]}',
        b'{"TENANTKV": 1}',
    ):
        assert may_bear(raw), raw
        assert scrub(json.loads(raw)) == 1, raw
    # and the common streamed chunk passes without a parse
    chunk = b'{"id":"c","object":"text_completion","choices":[{"index":0,"text":"hi"}]}'
    assert not may_bear(chunk)


# ------------------------------------------------------------------ event streams

newlines = st.sampled_from(["\n", "\n", "\r\n", "\r"])


@st.composite
def event_streams(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    """A stream of events (JSON data lines, [DONE], comments, other fields, odd lines) with
    random line endings, as bytes, and the same bytes cut into random chunks."""
    parts: list[str] = []
    for _ in range(draw(st.integers(0, 6))):
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(st.sampled_from(["json", "json", "done", "comment", "field", "raw"]))
            if kind == "json":
                value = draw(json_values)
                text = json.dumps(value, ensure_ascii=draw(st.booleans()))
                line = "data: " + text if draw(st.booleans()) else "data:" + text
            elif kind == "done":
                line = "data: [DONE]"
            elif kind == "comment":
                line = ": keep-alive"
            elif kind == "field":
                line = draw(st.sampled_from(["event: x", "id: 7", "retry: 10", "data:"]))
            else:
                line = draw(st.text(max_size=15))
            parts.append(line + draw(newlines))
        parts.append(draw(newlines))  # the blank line that ends the event
    if draw(st.booleans()):
        parts.append(draw(st.text(max_size=10)))  # a stream that stops mid-event
    raw = "".join(parts).encode("utf-8")
    cuts = sorted(draw(st.lists(st.integers(0, len(raw)), max_size=8)))
    chunks = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    return raw, [c for c in chunks if c]


def line_path(chunks: list[bytes]) -> bytes:
    """The rule as the gateway applied it before the byte path: httpx's line splitting, each
    line scrubbed, events joined by LF (the reference the cleaner must equal)."""

    async def body() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    async def run() -> bytes:
        response = httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=body()
        )
        out: list[bytes] = []
        lines: list[str] = []
        async for line in response.aiter_lines():
            lines.append(scrub_event_line(line))
            if not line:
                out.append("\n".join(lines).encode() + b"\n")
                lines.clear()
        if lines:
            out.append("\n".join(lines).encode() + b"\n\n")
        return b"".join(out)

    return asyncio.run(run())


def cleaned(chunks: list[bytes]) -> tuple[bytes, list[bytes]]:
    cleaner = EventCleaner(scrub_event_line)
    pieces = [cleaner.feed(chunk) for chunk in chunks]
    pieces.append(cleaner.end())
    return b"".join(pieces), pieces


#: Enough random streams to meet every kind of line and cut, within a few seconds.
STREAMS = settings(max_examples=60)


@STREAMS
@given(event_streams())
def test_the_cleaner_sends_what_the_line_rule_sends(stream: tuple[bytes, list[bytes]]) -> None:
    raw, chunks = stream
    out, _ = cleaned(chunks)
    assert out == line_path(chunks)
    assert out == line_path([raw])  # the cut does not matter either


@STREAMS
@given(event_streams())
def test_no_cleaned_event_holds_a_removable_key(stream: tuple[bytes, list[bytes]]) -> None:
    _, chunks = stream
    out, _ = cleaned(chunks)
    for line in out.decode("utf-8", "replace").splitlines():
        if line.startswith("data:"):
            try:
                data = json.loads(line[5:])
            except ValueError:
                continue
            assert bearing_keys(data) == 0, line


def test_keys_split_across_chunks_are_removed_and_events_leave_as_they_complete() -> None:
    event = b'data: {"choices":[{"text":"a"}],"kv_transfer_params":{"x":1},"usage":{"n":1}}\n\n'
    plain = b'data: {"choices":[{"text":"b"}]}\n\n'
    cut = event.index(b"transfer")  # the key's name is cut in two
    cleaner = EventCleaner(scrub_event_line)
    assert cleaner.feed(plain[:10]) == b""  # nothing complete yet
    assert cleaner.feed(plain[10:]) == plain  # passed as it is, at once
    assert cleaner.feed(event[:cut]) == b""
    first = cleaner.feed(event[cut:])
    assert b"kv_transfer" not in first and b'"usage":{"n":1}' in first
    assert json.loads(first.decode()[5:]) == {"choices": [{"text": "a"}], "usage": {"n": 1}}
    assert cleaner.end() == b""
