"""Paged KV for a Hugging Face ``transformers`` model next to an embedded engine.

A transformers model keeps its KV in a ``DynamicCache``: per layer, keys and values of shape
``[batch, kv_heads, tokens, head_dim]``. The engine copies paged blocks. :class:`PagedKV`
joins the two with vLLM's FlashAttention page layout, one ``(2, num_blocks, block_size,
kv_heads, head_dim)`` tensor per layer:

* :meth:`PagedKV.write` copies a cache's tokens into blocks (what a serving engine's
  attention does as it runs);
* :meth:`PagedKV.as_cache` gives the blocks back as a ``DynamicCache`` whose layers are
  *views* of the pages when the blocks are consecutive (nothing is copied: K of one layer
  is ``pages[0, first:last]`` seen as ``[1, kv_heads, tokens, head_dim]``); for scattered
  blocks it gathers them (one device copy per tensor) and says so;
* :meth:`PagedKV.kv_caches` registers the pages with :class:`~kvcache_offload.OffloadEngine`
  (K and V are two canonical tensors per layer: ``refs_per_layer=2`` for
  ``load_layerwise``);
* :func:`wait_for_layers` makes each decoder layer's forward wait on its layer's copy of a
  layer-wise load (a forward pre-hook per layer; a stream wait on CUDA); for scattered
  blocks, whose cache is a gather taken before the copy, :meth:`PagedKV.refresh_layer`
  gathers each layer again once its copy is in.

A blocks-first page (K and V of one block side by side) cannot be viewed as the model's
cache: K of consecutive blocks would not be evenly strided. Only batch 1 is handled.
Importing this module needs ``torch``; ``transformers`` is imported when a cache is built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcache_offload.contracts.kv_caches import CanonicalKVCaches
from kvcache_offload.dataplane import layouts
from kvcache_offload.errors import ConfigError

__all__ = ["PagedKV", "wait_for_layers"]


def _consecutive(block_ids: Sequence[int]) -> bool:
    return all(b == block_ids[0] + i for i, b in enumerate(block_ids))


class PagedKV:
    """Per-layer FlashAttention-layout pages for one model (see the module docstring)."""

    refs_per_layer = 2
    """Canonical refs per layer (K and V), for ``OffloadEngine.load_layerwise``."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if min(num_layers, num_blocks, block_size, kv_heads, head_dim) < 1:
            raise ConfigError("PagedKV needs positive sizes")
        self.block_size = block_size
        self.pages = [
            torch.zeros((2, num_blocks, block_size, kv_heads, head_dim), dtype=dtype, device=device)
            for _ in range(num_layers)
        ]

    @classmethod
    def for_model(
        cls,
        config: Any,
        num_blocks: int,
        block_size: int = 16,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> PagedKV:
        """Pages shaped for a transformers model ``config`` (Llama-like attention), in
        ``dtype`` (default: the model's parameters' dtype if the config names none)."""
        text = (
            config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        )
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(
            num_layers=text.num_hidden_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            head_dim=head_dim,
            dtype=dtype or _torch_dtype(getattr(text, "dtype", None)),
            device=device if device is not None else "cpu",
        )

    @property
    def num_layers(self) -> int:
        return len(self.pages)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over every layer (K and V): what the CPU tier stores per key."""
        page = self.pages[0]
        return page[:, 0].numel() * page.element_size() * len(self.pages)

    def kv_caches(self) -> CanonicalKVCaches:
        """The pages as the engine's canonical tensors (K, V of layer 0, then layer 1, ...)."""
        return layouts.kv_first_per_layer(self.pages)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (the last may be partial)."""
        return -(-num_tokens // self.block_size)

    def write(self, cache: Any, block_ids: Sequence[int], num_tokens: int | None = None) -> None:
        """Copy the first ``num_tokens`` tokens (default: all) of every layer of ``cache``
        into ``block_ids`` (in token order)."""
        for layer, page in enumerate(self.pages):
            keys, values = _layer_kv(cache, layer)
            tokens = keys.shape[-2] if num_tokens is None else num_tokens
            n = self.blocks_for(tokens)
            if len(block_ids) < n:
                raise ConfigError(f"{tokens} tokens need {n} blocks, got {len(block_ids)}")
            ids = torch.as_tensor(list(block_ids[:n]), device=page.device)
            for side, states in ((0, keys), (1, values)):
                if states.shape[0] != 1:
                    raise ConfigError(f"PagedKV handles batch 1, got {states.shape[0]}")
                flat = states[0, :, :tokens].transpose(0, 1)  # [tokens, heads, dim]
                full = (tokens // self.block_size) * self.block_size
                if full:
                    page[side].index_copy_(
                        0, ids[: full // self.block_size],
                        flat[:full].reshape(-1, self.block_size, *flat.shape[1:]),
                    )  # fmt: skip
                if full < tokens:
                    page[side, int(block_ids[n - 1]), : tokens - full] = flat[full:]

    def layer_views(
        self, block_ids: Sequence[int], num_tokens: int
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool]:
        """Per layer ``(K, V)`` as ``[1, kv_heads, num_tokens, head_dim]`` and whether they
        had to be gathered (a copy) rather than viewed."""
        views = [self.layer_view(layer, block_ids, num_tokens) for layer in range(len(self.pages))]
        return views, not _consecutive(list(block_ids[: self.blocks_for(num_tokens)]))

    def layer_view(
        self, layer: int, block_ids: Sequence[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s ``(K, V)`` as ``[1, kv_heads, num_tokens, head_dim]``: a view
        of the page for consecutive blocks, a gather (a copy, taken now) otherwise."""
        n = self.blocks_for(num_tokens)
        if len(block_ids) < n:
            raise ConfigError(f"{num_tokens} tokens need {n} blocks, got {len(block_ids)}")
        ids = list(block_ids[:n])
        page = self.pages[layer]
        if _consecutive(ids):
            kv = page[:, ids[0] : ids[0] + n]
        else:
            kv = page.index_select(1, torch.as_tensor(ids, device=page.device))
        kv = kv.flatten(1, 2)[:, :num_tokens]  # [2, tokens, heads, dim]
        kv = kv.permute(0, 2, 1, 3).unsqueeze(1)  # [2, 1, heads, tokens, dim]
        return kv[0], kv[1]

    def refresh_layer(
        self, cache: Any, layer: int, block_ids: Sequence[int], num_tokens: int
    ) -> None:
        """Point layer ``layer`` of ``cache`` (from :meth:`as_cache`) at the pages again: a
        gathered cache is a snapshot, so after a layer-wise load into scattered blocks each
        layer is gathered anew once its copy is in (``wait_for_layers(..., after=...)``)."""
        entry: Any = cache.layers[layer]
        entry.keys, entry.values = self.layer_view(layer, block_ids, num_tokens)

    def as_cache(self, block_ids: Sequence[int], num_tokens: int, config: Any = None) -> Any:
        """A ``DynamicCache`` holding ``num_tokens`` tokens from ``block_ids``: views of the
        pages for consecutive blocks (no copy), a gather otherwise. A gather reads the pages
        now: for a layer-wise load into scattered blocks, see :meth:`refresh_layer`."""
        from transformers import DynamicCache

        cache: Any = DynamicCache(config=config) if config is not None else DynamicCache()
        views, _ = self.layer_views(block_ids, num_tokens)
        for layer, (k, v) in enumerate(views):
            while len(cache.layers) <= layer:
                cache.layers.append(cache.layer_class_to_replicate())
            entry: Any = cache.layers[layer]
            entry.lazy_initialization(k, v)
            entry.keys, entry.values = k, v
        return cache


def _torch_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        return getattr(torch, value)  # type: ignore[no-any-return]
    return torch.get_default_dtype()


def _layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # transformers before 4.56


def wait_for_layers(
    decoder_layers: Sequence[Any], handle: Any, after: Callable[[int], None] | None = None
) -> Any:
    """Make each of ``decoder_layers`` (e.g. ``model.model.layers``) wait, just before its
    forward, on its layer's copy in the layer-wise load ``handle``, then call ``after(i)``
    if given (e.g. :meth:`PagedKV.refresh_layer` for scattered blocks); returns a callable
    that removes the hooks."""
    if len(decoder_layers) != handle.num_layers:
        raise ConfigError(
            f"{len(decoder_layers)} decoder layers, but the load copies {handle.num_layers}"
        )
    hooks = []
    for i, module in enumerate(decoder_layers):

        def pre_hook(_module: Any, _args: Any, layer: int = i) -> None:
            handle.wait_layer(layer)
            if after is not None:
                after(layer)

        hooks.append(module.register_forward_pre_hook(pre_hook))

    def remove() -> None:
        for hook in hooks:
            hook.remove()

    return remove
