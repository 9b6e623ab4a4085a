"""The commands, files and request bodies the docs show, taken out of their Markdown, so that
the tests run what a reader copies (docs/deploy.md's configuration file, the ``vllm serve``
line and the gateway's request body of docs/engines.md and docs/gateway.md)."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent.parent / "docs"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def fenced_blocks(doc: str, language: str) -> list[str]:
    """The fenced blocks of ``docs/<doc>`` in ``language``, in order."""
    text = (DOCS / doc).read_text(encoding="utf-8")
    return [body for lang, body in _FENCE.findall(text) if lang == language]


def one_block(doc: str, language: str, containing: str) -> str:
    """The one ``language`` block of ``doc`` that contains ``containing``."""
    found = [b for b in fenced_blocks(doc, language) if containing in b]
    assert len(found) == 1, f"docs/{doc}: {len(found)} {language} blocks with {containing!r}"
    return found[0]


def command_args(block: str, program: str) -> list[str]:
    """The arguments of the shell command in ``block`` that starts with ``program``, as the
    shell would split them (continuation lines joined)."""
    words = shlex.split(block.replace("\\\n", " "), comments=True)
    head = program.split()
    for start in range(len(words)):
        if words[start : start + len(head)] == head:
            return words[start + len(head) :]
    raise AssertionError(f"no {program!r} command in {block!r}")


def deploy_example() -> tuple[str, dict[str, Any]]:
    """docs/deploy.md's full configuration file: its text and its parsed tables."""
    text = one_block("deploy.md", "toml", "# /etc/tenantkv/tenantkv.toml")
    return text, tomllib.loads(text)


def vllm_serve_args(doc: str) -> list[str]:
    """The arguments after ``vllm serve`` in ``docs/<doc>``'s recipe."""
    return command_args(one_block(doc, "bash", "vllm serve"), "vllm serve")


def kv_transfer_config(args: list[str]) -> dict[str, Any]:
    """The JSON of ``--kv-transfer-config`` in ``args``."""
    config: dict[str, Any] = json.loads(args[args.index("--kv-transfer-config") + 1])
    return config


def curl_body(doc: str) -> dict[str, Any]:
    """The JSON request body (``-d``) of ``docs/<doc>``'s ``curl`` to the gateway."""
    args = command_args(one_block(doc, "bash", "curl "), "curl")
    body: dict[str, Any] = json.loads(args[args.index("-d") + 1])
    return body


def toml_value(value: Any) -> str:
    """``value`` (a string, number, boolean or list of them) as TOML text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def toml_text(tables: dict[str, dict[str, Any]]) -> str:
    """``tables`` as a TOML file of ``[table]`` sections of plain keys."""
    return "".join(
        f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in table.items()) + "\n"
        for name, table in tables.items()
    )
