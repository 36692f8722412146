"""A layer-wise load into scattered blocks: the cache is a gather taken before the copy, so
each layer must be gathered again once its copy is in (``wait_for_layers(after=...)`` with
``PagedKV.refresh_layer``) to give the logits of the KV that never left the device."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench._ttft_model import build_model, forward, new_cache  # noqa: E402
from kvcache_offload.integrations.transformers import PagedKV, wait_for_layers  # noqa: E402


class _LandsAtWait:
    """A layer-wise handle whose layer i lands in the pages when the model waits on it."""

    def __init__(self, paged: PagedKV, stored: list[torch.Tensor]) -> None:
        self.paged, self.stored = paged, stored
        self.num_layers = len(stored)

    def wait_layer(self, layer: int) -> None:
        self.paged.pages[layer].copy_(self.stored[layer])


def _turn_logits(refresh: bool) -> tuple[torch.Tensor, torch.Tensor]:
    model = build_model(True, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, model.config.vocab_size, (1, 40), generator=gen)
    turn = torch.randint(0, model.config.vocab_size, (1, 5), generator=gen)
    ref = new_cache(model)
    forward(model, ctx, ref)
    paged = PagedKV.for_model(model.config, 8, 16, "cpu", torch.float32)
    blocks = [5, 1, 3]
    paged.write(ref, blocks, 40)
    stored = [page.clone() for page in paged.pages]
    for page in paged.pages:
        page.fill_(-3)  # the load has not landed yet
    hit = forward(model, turn, ref)
    cache = paged.as_cache(blocks, 40, model.config)

    def after(layer: int) -> None:
        paged.refresh_layer(cache, layer, blocks, 40)

    remove = wait_for_layers(
        model.model.layers, _LandsAtWait(paged, stored), after if refresh else None
    )
    try:
        return forward(model, turn, cache), hit
    finally:
        remove()


def test_scattered_layerwise_restore_gives_the_device_kvs_logits_when_layers_are_refreshed() -> (
    None
):
    logits, hit = _turn_logits(refresh=True)
    assert torch.equal(logits, hit)


def test_a_gathered_cache_is_a_snapshot_taken_before_the_layers_land() -> None:
    logits, hit = _turn_logits(refresh=False)
    assert not torch.equal(logits, hit)
