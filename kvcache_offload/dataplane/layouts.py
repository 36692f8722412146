"""Build :class:`CanonicalKVCaches` from the KV-cache layouts attention backends use.

A canonical tensor is an int8 ``(num_blocks, page_bytes)`` view whose row ``b`` holds block
``b`` of one layer (or of all layers, cross-layer); each layer's
:class:`CanonicalKVCacheRef` names its tensor and the *un-padded* bytes to copy. Builders:

* :func:`kv_first_per_layer`: one ``(2, num_blocks, block, heads, dim)`` tensor per layer
  (FlashAttention style); K and V become two canonical tensors, so a layer has two refs.
* :func:`blocks_first_per_layer`: one ``(num_blocks, ...)`` tensor per layer, e.g.
  ``(num_blocks, 2, block, heads, dim)`` (FlashInfer style); one canonical tensor per layer.
* :func:`cross_layer`: one ``(num_blocks, ...)`` tensor holding every layer of a block.
* :func:`mla_per_layer`: MLA-style single latent tensors ``(num_blocks, block, latent_dim)``.
* :func:`from_block_views`: the general form: per layer, a list of blocks-first views.

Padded pages: a view whose block stride exceeds its data (``stride(0) > prod(shape[1:])``)
gets a canonical row of the full padded stride when the storage holds it (else of the data
bytes), and a ref of the data bytes: padding is never copied. The bytes inside a block must
be dense (``view[b]`` contiguous). Layers that share storage (same address, stride and
rows) share one canonical tensor. ``groups`` lists each KV-cache group's layer indices
(default: one group of every layer, in order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache_offload.contracts.kv_caches import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)
from kvcache_offload.errors import ConfigError

__all__ = [
    "block_nbytes",
    "blocks_first_per_layer",
    "canonical_block_view",
    "cross_layer",
    "from_block_views",
    "kv_first_per_layer",
    "mla_per_layer",
]


def canonical_block_view(view: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(int8 (num_blocks, row_bytes) view, data bytes per block)`` of a blocks-first view."""
    if view.dim() < 1:
        raise ConfigError("a KV view needs a leading num_blocks dimension")
    num_blocks = int(view.shape[0])
    es = view.element_size()
    data_bytes = es
    for d in view.shape[1:]:
        data_bytes *= int(d)
    if num_blocks and not view[0].is_contiguous():
        raise ConfigError(
            f"the bytes of one block must be dense, got shape {tuple(view.shape)} and "
            f"strides {view.stride()} (split K/V-first layouts with kv_first_per_layer)"
        )
    stride_bytes = int(view.stride(0)) * es if view.dim() > 1 or num_blocks > 1 else data_bytes
    if num_blocks > 1 and stride_bytes < data_bytes:
        raise ConfigError(
            f"blocks overlap: block stride {stride_bytes} bytes < {data_bytes} data bytes"
        )
    if num_blocks <= 1:
        stride_bytes = max(stride_bytes, data_bytes)
    storage = view.untyped_storage()
    offset = view.storage_offset() * es
    row = stride_bytes if offset + num_blocks * stride_bytes <= storage.nbytes() else data_bytes
    flat = torch.empty(0, dtype=torch.int8, device=view.device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    canon = torch.as_strided(flat, (num_blocks, row), (stride_bytes, 1), offset)
    return canon, data_bytes


def from_block_views(
    layers: Sequence[Sequence[torch.Tensor]],
    groups: Sequence[Sequence[int]] | None = None,
) -> CanonicalKVCaches:
    """``layers[i]`` is the list of blocks-first views of layer i (e.g. ``[K, V]``)."""
    if not layers:
        raise ConfigError("need at least one layer")
    tensors: list[CanonicalKVCacheTensor] = []
    index: dict[tuple[object, ...], int] = {}
    layer_refs: list[list[CanonicalKVCacheRef]] = []
    num_blocks: int | None = None
    for li, views in enumerate(layers):
        if not views:
            raise ConfigError(f"layer {li} has no tensors")
        refs = []
        for view in views:
            canon, data_bytes = canonical_block_view(view)
            if num_blocks is None:
                num_blocks = int(canon.shape[0])
            elif canon.shape[0] != num_blocks:
                raise ConfigError(
                    f"layer {li} has {canon.shape[0]} blocks, layer 0 has {num_blocks}"
                )
            key = (canon.device, canon.data_ptr(), canon.stride(0), int(canon.shape[1]))
            idx = index.get(key)
            if idx is None:
                idx = index[key] = len(tensors)
                tensors.append(CanonicalKVCacheTensor(canon, int(canon.shape[1])))
            refs.append(CanonicalKVCacheRef(idx, data_bytes))
        layer_refs.append(refs)
    if groups is None:
        groups = [list(range(len(layers)))]
    group_refs: list[list[CanonicalKVCacheRef]] = []
    for gi, members in enumerate(groups):
        refs = []
        for li in members:
            if not 0 <= li < len(layers):
                raise ConfigError(f"group {gi} names layer {li}, but there are {len(layers)}")
            refs.extend(layer_refs[li])
        group_refs.append(refs)
    return CanonicalKVCaches(tensors, group_refs)


def kv_first_per_layer(
    tensors: Sequence[torch.Tensor], groups: Sequence[Sequence[int]] | None = None
) -> CanonicalKVCaches:
    """Per-layer ``(2, num_blocks, ...)`` tensors; K and V are two canonical tensors."""
    layers = []
    for i, t in enumerate(tensors):
        if t.dim() < 2 or t.shape[0] != 2:
            raise ConfigError(
                f"layer {i}: expected a (2, num_blocks, ...) tensor, got shape {tuple(t.shape)}"
            )
        layers.append([t[0], t[1]])
    return from_block_views(layers, groups)


def blocks_first_per_layer(
    tensors: Sequence[torch.Tensor], groups: Sequence[Sequence[int]] | None = None
) -> CanonicalKVCaches:
    """Per-layer ``(num_blocks, ...)`` tensors, e.g. ``(num_blocks, 2, block, heads, dim)``."""
    return from_block_views([[t] for t in tensors], groups)


def mla_per_layer(
    tensors: Sequence[torch.Tensor], groups: Sequence[Sequence[int]] | None = None
) -> CanonicalKVCaches:
    """MLA latent caches: one ``(num_blocks, block, latent_dim)`` tensor per layer."""
    for i, t in enumerate(tensors):
        if t.dim() != 3:
            raise ConfigError(
                f"layer {i}: expected an MLA (num_blocks, block, latent_dim) tensor, got shape "
                f"{tuple(t.shape)}"
            )
    return from_block_views([[t] for t in tensors], groups)


def cross_layer(tensor: torch.Tensor) -> CanonicalKVCaches:
    """One ``(num_blocks, ...)`` tensor holding every layer of a block: one tensor, one ref."""
    return from_block_views([[tensor]])


def block_nbytes(kv_caches: CanonicalKVCaches) -> int:
    """Bytes of one GPU block over all canonical tensors (padded rows): a CPU cell's size
    for ``block_size_factor`` 1 on one worker."""
    return sum(int(t.page_size_bytes) for t in kv_caches.tensors)
