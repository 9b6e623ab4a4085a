"""Where a load puts each layer: fresh tensors, or the caller's own (possibly paged) buffers.

Inference engines replay CUDA graphs over fixed pointers and keep KV in paged pools, so a load
must be able to write into buffers the engine already owns (``out=``), at given rows
(``block_rows``: the first row of each 64-token block). Without ``out=`` each layer is a fresh
tensor of exactly the loaded rows.

On the CPU, a destination whose rows are plain bytes (a fresh layer, an MLA buffer) is decrypted
into directly, with no copy. Otherwise (MHA ``out=`` buffers, which keep k and v apart, every
CUDA target, and every namespace with a lossy codec) the chunk is decrypted into its staging slot
and copied out from there; a codec's segments are decoded straight into the destination rows
instead of copied (on a GPU after the copy to the device, so the link carries the codes).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import InvalidRequestError
from ..layout import KVLayout, Layer
from ..prefix import BLOCK_TOKENS
from ..tensor_checks import check_dense, check_disjoint
from .buffers import RecyclingPool


def _check_buffer(
    what: str,
    tensor: Any,
    layout: KVLayout,
    device: torch.device,
    tail: tuple[int, ...],
    rows: int,
) -> torch.Tensor:
    """``tensor`` if it can receive ``rows`` rows of ``layout``, else InvalidRequestError naming
    ``what``."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequestError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    check_dense(what, tensor)
    if tensor.dtype != layout.dtype:
        raise InvalidRequestError(
            f"{what} has dtype {tensor.dtype}, the layout says {layout.dtype}"
        )
    if tensor.device != device:
        raise InvalidRequestError(f"{what} is on {tensor.device}, the load targets {device}")
    if tensor.dim() != 1 + len(tail) or tensor.shape[1:] != tail:
        raise InvalidRequestError(
            f"{what} has shape {list(tensor.shape)}, expected [rows, {', '.join(map(str, tail))}]"
        )
    if tensor.shape[0] < rows:
        raise InvalidRequestError(f"{what} has {tensor.shape[0]} rows, the load needs {rows}")
    if not tensor.is_contiguous():
        raise InvalidRequestError(f"{what} must be contiguous")
    return tensor


def _normalise_device(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class LayerOutput:
    """The destination of one layer of one load."""

    def __init__(
        self,
        *,
        rows: torch.Tensor | None,
        pair: tuple[torch.Tensor, torch.Tensor] | None,
        result: Layer,
        host_bytes: memoryview | None = None,
    ) -> None:
        self.rows = rows  # uint8 [R, token_bytes], when the destination is byte-addressable
        self.pair = pair  # (k, v) buffers of an MHA out=
        self.result = result
        #: the destination's bytes, when it is in host memory in the stored row format
        self.bytes = host_bytes
        if host_bytes is None and rows is not None and rows.device.type == "cpu":
            self.bytes = memoryview(rows.numpy()).cast("B")  # type: ignore[arg-type]


class LoadTarget:
    """Validated destinations for every layer of one load."""

    def __init__(
        self,
        layout: KVLayout,
        device: torch.device,
        num_blocks: int,
        out: Sequence[Any] | None,
        block_rows: Sequence[int] | None,
        host_pool: RecyclingPool | None = None,
        block_tokens: int = BLOCK_TOKENS,
        inputs: Sequence[torch.Tensor] = (),
    ) -> None:
        """``inputs``: the caller's input tensors (tokens), which no ``out=`` buffer may share
        memory with."""
        self.layout = layout
        self._inputs = [t for t in inputs if isinstance(t, torch.Tensor)]
        self.block_tokens = block_tokens
        self._host_pool = host_pool
        self.device = _normalise_device(device)
        self.num_blocks = num_blocks
        self.block_rows = self._check_block_rows(
            block_rows, num_blocks, out is not None, block_tokens
        )
        rows_needed = max(self.block_rows, default=-block_tokens) + block_tokens
        self.out = self._check_out(out, rows_needed) if out is not None else None
        #: decrypt straight into the destination bytes (no staging copy)
        self.direct = (
            self.device.type == "cpu"
            and not layout.encoded
            and (out is None or layout.strategy.decrypts_into_out)
        )

    @staticmethod
    def _check_block_rows(
        block_rows: Sequence[int] | None, num_blocks: int, has_out: bool, block_tokens: int
    ) -> list[int]:
        if block_rows is None:
            return [b * block_tokens for b in range(num_blocks)]
        if not has_out:
            raise InvalidRequestError("block_rows needs out= buffers to place the rows in")
        rows = list(block_rows)
        if len(rows) != num_blocks:
            raise InvalidRequestError(
                f"block_rows has {len(rows)} entries, the load has {num_blocks} blocks"
            )
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in rows):
            raise InvalidRequestError("block_rows must be non-negative integers")
        ordered = sorted(rows)
        if any(b - a < block_tokens for a, b in itertools.pairwise(ordered)):
            raise InvalidRequestError(
                f"block_rows overlap: each block takes {block_tokens} consecutive rows"
            )
        return rows

    def _check_out(self, out: Sequence[Any], rows_needed: int) -> list[Any]:
        layout = self.layout
        if isinstance(out, torch.Tensor) or not isinstance(out, Sequence):
            raise InvalidRequestError(f"out must be a sequence of {layout.num_layers} buffers")
        if len(out) != layout.num_layers:
            raise InvalidRequestError(
                f"out has {len(out)} buffers, the layout has {layout.num_layers} layers"
            )
        checked: list[Any] = []
        named: list[tuple[str, torch.Tensor]] = []
        kind = layout.strategy
        tail = kind.out_tail(layout)
        device = self.device

        def check(what: str, tensor: Any) -> torch.Tensor:
            buffer = _check_buffer(what, tensor, layout, device, tail, rows_needed)
            named.append((what, buffer))
            return buffer

        for index, entry in enumerate(out):
            yielded, _parts = kind.out_parts(entry, f"out[{index}]", check)
            checked.append(yielded)
        # Buffers that share bytes (one view overlapping another, or the tokens) would have one
        # layer's rows overwrite another's: refused before anything is read.
        check_disjoint(named + [("tokens", t) for t in self._inputs])
        return checked

    def new_layer(self, layer: int) -> LayerOutput:
        layout = self.layout
        if self.out is None:
            num_tokens = self.num_blocks * self.block_tokens
            if self.device.type == "cpu" and self._host_pool is not None:
                # Straight over the pool's bytes, in few calls: a worker makes each layer's
                # destination under the stream's lock.
                host = self._host_pool.buffer(num_tokens * layout.token_bytes)
                values = torch.frombuffer(host, dtype=layout.dtype)
                result = layout.layer_from_values(values, num_tokens)
                # Staged chunks (a codec's, decoded) are copied into rows over the same bytes.
                rows = None if self.direct else values.view(torch.uint8).view(num_tokens, -1)
                return LayerOutput(rows=rows, pair=None, result=result, host_bytes=host)
            rows = layout.empty_rows(num_tokens, self.device)
            return LayerOutput(rows=rows, pair=None, result=layout.layer_from_rows(rows))
        entry = self.out[layer]
        out_rows = layout.strategy.out_rows(layout, entry)
        if out_rows is not None:
            return LayerOutput(rows=out_rows, pair=None, result=entry)
        return LayerOutput(rows=None, pair=layout.strategy.out_pair(entry), result=entry)

    def finish(self, layers_in_flight: int) -> None:
        """The load is over: let the layer pool release what no load reuses, keeping at least
        the ``layers_in_flight`` fresh layers a load like this one fills at once (so the next
        one faults in no new pages, however long its layers, even after loads of other
        lengths in between)."""
        if self._host_pool is not None and self.out is None:
            layer_bytes = self.num_blocks * self.block_tokens * self.layout.token_bytes
            self._host_pool.trim(keep=layers_in_flight * layer_bytes, layer_bytes=layer_bytes)

    def place(self, output: LayerOutput, first_position: int, plain: torch.Tensor) -> None:
        """Copy a staged chunk (``[count, segment_bytes]`` uint8: ``count`` stored segments) to
        its destination rows, decoding a codec's segments on the way.

        On CUDA the copies (and the decoding) are queued on the current stream (the load's);
        the caller records an event after them and keeps the staging slot until that event has
        completed.
        """
        count = plain.shape[0]
        layout = self.layout
        if self.device.type == "cuda" and (output.pair is not None or layout.encoded):
            # Then split k/v, or decode, on the device: the link carries the codes.
            plain = plain.to(self.device, non_blocking=True)
        if layout.encoded:
            self._decode(output, first_position, plain)
            return
        plain = plain.view(count * self.block_tokens, layout.token_bytes)
        offset = 0
        for start, length in self._row_runs(first_position, count):
            block = plain[offset : offset + length]
            offset += length
            if output.rows is not None:
                output.rows[start : start + length].copy_(block, non_blocking=True)
                continue
            assert output.pair is not None, "a staged MHA layer has its (k, v) buffers"
            k, v = layout.strategy.split_rows(layout, block, length)
            output.pair[0][start : start + length].copy_(k, non_blocking=True)
            output.pair[1][start : start + length].copy_(v, non_blocking=True)

    def _decode(self, output: LayerOutput, first_position: int, codes: torch.Tensor) -> None:
        """Decode a chunk's segments straight into the destination rows (each value written
        once: on the CPU by the C decoders, in one pass from the codes)."""
        layout = self.layout
        components = layout.components()
        if output.rows is not None:
            values = output.rows.view(layout.dtype)  # [R, values_per_token], contiguous
            destinations = [(values, c.start) for c in components]
        else:
            # An MHA out= pair: component i (k, then v) goes to buffer i, [R, H * D].
            assert output.pair is not None, "a staged MHA layer has its (k, v) buffers"
            assert len(components) == len(output.pair), "one out= buffer per component"
            destinations = [(t.view(t.shape[0], -1), 0) for t in output.pair]
        row_starts = self.block_rows[first_position : first_position + codes.shape[0]]
        layout.coder.decode_into(layout, codes, self.block_tokens, destinations, row_starts)

    def _row_runs(self, first_position: int, count: int) -> list[tuple[int, int]]:
        """Destination row ranges of blocks ``first_position ..``, merged where consecutive.

        Returned as (start row, row count) with one entry per merged run; ``place`` walks the
        chunk's rows in the same order.
        """
        runs: list[tuple[int, int]] = []
        for p in range(first_position, first_position + count):
            start = self.block_rows[p]
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + self.block_tokens)
            else:
                runs.append((start, self.block_tokens))
        return runs
