"""Types of the C accelerator tenantkv/_prefix_chain.c (see tenantkv.prefix.block_keys)."""

from typing_extensions import Buffer

def block_keys(
    key: Buffer, person: Buffer, seed: Buffer, data: Buffer, block_bytes: int, /
) -> list[bytes]: ...
