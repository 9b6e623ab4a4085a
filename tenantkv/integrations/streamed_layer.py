"""A transformers cache whose restored prefix arrives layer by layer while the model runs.

``PrefixCache.restore(..., streaming=True)`` returns a ``DynamicCache`` of
:class:`StreamedLayer` s. Each knows how many tokens it will hold, so the model can compute
positions and masks and start layer 0 at once; a layer's cached prefix is taken from the load
stream the first time the model touches that layer (its ``update`` in the attention), so layer
i computes while layers i+1, ... are still being read and decrypted. On CUDA the take makes the
current stream wait on the layer's event, with no host synchronisation.

The stream is closed as soon as the last layer is taken, when :meth:`LayerFeed.close` is called,
or when the cache is garbage-collected. A load that fails mid-way raises its ``LoadError`` from
the forward pass that needed the layer (the damaged extent is already evicted): the caller
recomputes the prompt without the cache.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..datapath.loader import LoadStream
from ..errors import CacheClosedError, InvalidRequestError
from ..layout import Layer

LayerConverter = Callable[[Layer], tuple[torch.Tensor, torch.Tensor]]


class LayerFeed:
    """Hands a load stream's layers, in order, to the cache layers that wait for them."""

    def __init__(self, stream: LoadStream, convert: LayerConverter) -> None:
        self.stream = stream
        self.num_tokens = stream.num_tokens
        self._convert = convert
        self._layers: Iterator[tuple[int, Layer]] = iter(stream)
        self._next = 0
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def take(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index`` as (keys, values); layers are taken in order (the model's order)."""
        with self._lock:
            if self._error is not None:
                raise self._error  # the same failure for every layer that can no longer arrive
            if index != self._next:
                raise InvalidRequestError(
                    f"restored layers are taken in order: layer {index} asked for before "
                    f"layer {self._next}"
                )
            try:
                received, layer = next(self._layers)
            except StopIteration:
                self._error = CacheClosedError("the restored prefix's load stream was closed")
                raise self._error from None
            except BaseException as err:
                self._error = err
                raise
            assert received == index, f"the load stream yielded layer {received}, not {index}"
            self._next += 1
            if self._next == self.stream.num_layers:
                self.stream.close()
            return self._convert(layer)

    def close(self) -> None:
        self.stream.close()


class StreamedLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """A ``DynamicLayer`` that takes its restored prefix from a :class:`LayerFeed` on first use.

    ``keys``/``values`` are properties so that every reader (the attention's ``update``, crop,
    offload, a later ``save``) receives the restored tokens, never an empty layer.
    """

    def __init__(self, feed: LayerFeed, index: int) -> None:
        self._feed: LayerFeed | None = feed
        self._index = index
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        super().__init__()  # type: ignore[no-untyped-call]

    def _arrive(self) -> None:
        feed = self._feed
        if feed is None:
            return
        keys, values = feed.take(self._index)  # raises on failure; the feed then stays set
        self._feed = None
        super().update(keys, values)  # copies out of the loader's buffer

    @property
    def keys(self) -> torch.Tensor | None:
        self._arrive()
        return self._keys

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._keys = value

    @property
    def values(self) -> torch.Tensor | None:
        self._arrive()
        return self._values

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._values = value

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._arrive()
        result: tuple[torch.Tensor, torch.Tensor] = super().update(
            key_states, value_states, *args, **kwargs
        )
        return result

    def get_seq_length(self) -> int:
        """The restored length before the layer arrives: positions and masks need no wait."""
        feed = self._feed
        if feed is not None:
            return feed.num_tokens
        length: int = super().get_seq_length()
        return length


def streamed_cache(config: Any, feed: LayerFeed, num_layers: int) -> DynamicCache:
    """A ``DynamicCache`` whose layers arrive from ``feed``; closing it when it is collected."""
    cache = DynamicCache(config=config)
    cache.layers = [StreamedLayer(feed, index) for index in range(num_layers)]
    weakref.finalize(cache, _close_quietly, feed)
    return cache


def _close_quietly(feed: LayerFeed) -> None:
    with contextlib.suppress(CacheClosedError):  # close is idempotent; be sure at exit
        feed.close()
