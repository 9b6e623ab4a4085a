"""Types of the C accelerator tenantkv/_token_ids.c (see tenantkv.tokens.as_token_array)."""

from typing import Any

def pack(tokens: list[Any] | tuple[Any, ...], /) -> bytearray: ...
