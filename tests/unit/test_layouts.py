"""Canonical KV-cache builders: geometry, padding, groups, and byte-exact round trips."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvcache_offload.contracts.load_store_spec import CPULoadStoreSpec, GPULoadStoreSpec  # noqa: E402
from kvcache_offload.dataplane.handlers.cpu_backend import CpuBackendOffloadingHandlers  # noqa: E402
from kvcache_offload.dataplane.layouts import (  # noqa: E402
    block_nbytes,
    blocks_first_per_layer,
    cross_layer,
    from_block_views,
    kv_first_per_layer,
    mla_per_layer,
)
from kvcache_offload.errors import ConfigError  # noqa: E402
from tests._roundtrip import finish  # noqa: E402

NB = 24  # GPU blocks


def _rand(shape, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def _round_trip_originals(kv, originals, factor=2, start=1, n=9, num_cpu=12, seed=0):
    """Store n blocks, poison the original (typed) tensors' blocks, load back, compare."""
    rng = np.random.default_rng(seed)
    gpu_ids = rng.choice(NB, n, replace=False)
    n_cpu = -(-(n + start % factor) // factor)
    cpu_ids = rng.choice(num_cpu, n_cpu, replace=False)
    groups = len(kv.group_data_refs)
    gpu_spec = GPULoadStoreSpec(gpu_ids, [n] + [0] * (groups - 1), [start] + [0] * (groups - 1))
    cpu_spec = CPULoadStoreSpec(cpu_ids)
    h = CpuBackendOffloadingHandlers(kv, factor, num_cpu)
    try:
        before = [t.clone() for t in originals]
        h.gpu_to_cpu_handler.transfer_async(1, (gpu_spec, cpu_spec))
        finish(h.gpu_to_cpu_handler, [1])
        for t in originals:
            t.view(torch.uint8).fill_(0xA5)
        h.cpu_to_gpu_handler.transfer_async(2, (cpu_spec, gpu_spec))
        finish(h.cpu_to_gpu_handler, [2])
        return before, gpu_ids
    finally:
        h.shutdown()


def test_kv_first_splits_k_and_v_into_two_canonical_tensors():
    layers = [_rand((2, NB, 16, 4, 8), seed=i) for i in range(3)]
    kv = kv_first_per_layer(layers)
    assert len(kv.tensors) == 6
    page = 16 * 4 * 8 * 2
    assert all(t.tensor.shape == (NB, page) and t.page_size_bytes == page for t in kv.tensors)
    assert [r.tensor_idx for r in kv.group_data_refs[0]] == list(range(6))
    assert block_nbytes(kv) == 6 * page
    # row b of the K tensor is exactly layer 0's K block b
    assert torch.equal(kv.tensors[0].tensor[5], layers[0][0, 5].reshape(-1).view(torch.int8))
    assert torch.equal(kv.tensors[1].tensor[5], layers[0][1, 5].reshape(-1).view(torch.int8))
    before, ids = _round_trip_originals(kv, layers)
    for t, b in zip(layers, before, strict=True):
        assert torch.equal(t[:, ids].view(torch.uint8), b[:, ids].view(torch.uint8))


def test_blocks_first_layout_is_one_tensor_per_layer():
    layers = [_rand((NB, 2, 16, 4, 8), seed=10 + i) for i in range(4)]
    kv = blocks_first_per_layer(layers, groups=[[0, 2], [1, 3]])
    assert len(kv.tensors) == 4 and len(kv.group_data_refs) == 2
    assert [r.tensor_idx for r in kv.group_data_refs[1]] == [1, 3]
    rng = np.random.default_rng(1)
    ids = rng.choice(NB, 8, replace=False)
    cpu = rng.choice(10, 8, replace=False)
    spec = GPULoadStoreSpec(ids, [4, 4], [0, 0])
    h = CpuBackendOffloadingHandlers(kv, 1, 10)
    try:
        before = [t.clone() for t in layers]
        h.gpu_to_cpu_handler.transfer_async(1, (spec, CPULoadStoreSpec(cpu)))
        finish(h.gpu_to_cpu_handler, [1])
        for t in layers:
            t.view(torch.uint8).fill_(7)
        h.cpu_to_gpu_handler.transfer_async(2, (CPULoadStoreSpec(cpu), spec))
        finish(h.cpu_to_gpu_handler, [2])
        g0 = torch.from_numpy(ids[:4])
        g1 = torch.from_numpy(ids[4:])
        for li, (t, b) in enumerate(zip(layers, before, strict=True)):
            mine = g0 if li in (0, 2) else g1
            other = g1 if li in (0, 2) else g0
            assert torch.equal(t[mine].view(torch.uint8), b[mine].view(torch.uint8))
            assert bool((t[other].view(torch.uint8) == 7).all())  # other group's blocks
    finally:
        h.shutdown()


def test_cross_layer_is_one_tensor_one_ref():
    t = _rand((NB, 6, 2, 16, 4, 8), seed=20)
    kv = cross_layer(t)
    assert len(kv.tensors) == 1 and len(kv.group_data_refs[0]) == 1
    assert kv.tensors[0].page_size_bytes == 6 * 2 * 16 * 4 * 8 * 2
    before, ids = _round_trip_originals(kv, [t], factor=3, start=2)
    assert torch.equal(t[ids].view(torch.uint8), before[0][ids].view(torch.uint8))


def test_mla_latent_tensors_and_shape_check():
    layers = [_rand((NB, 16, 72), seed=30 + i) for i in range(2)]
    kv = mla_per_layer(layers)
    assert len(kv.tensors) == 2 and kv.tensors[0].page_size_bytes == 16 * 72 * 2
    before, ids = _round_trip_originals(kv, layers, factor=1, start=0)
    for t, b in zip(layers, before, strict=True):
        assert torch.equal(t[ids].view(torch.uint8), b[ids].view(torch.uint8))
    with pytest.raises(ConfigError):
        mla_per_layer([_rand((NB, 16, 4, 8))])


def test_padded_pages_copy_data_only_and_never_padding():
    # storage rows of 1,000 bytes of which each block uses 16 * 4 * 6 * 2 = 768
    storage = torch.zeros((NB, 1000), dtype=torch.uint8)
    storage.view(-1).copy_(torch.randint(0, 256, (NB * 1000,), dtype=torch.uint8))
    view = storage[:, :768].view(torch.bfloat16).view(NB, 16, 4, 6)
    kv = from_block_views([[view]])
    assert kv.tensors[0].page_size_bytes == 1000  # padded canonical row
    assert kv.group_data_refs[0][0].page_size_bytes == 768  # un-padded copy size
    rng = np.random.default_rng(2)
    ids = rng.choice(NB, 5, replace=False)
    h = CpuBackendOffloadingHandlers(kv, 1, 8)
    try:
        for c in h.cpu_tensors:
            c.fill_(-1)
        spec = (GPULoadStoreSpec(ids, [5], [0]), CPULoadStoreSpec([0, 1, 2, 3, 4]))
        h.gpu_to_cpu_handler.transfer_async(1, spec)
        finish(h.gpu_to_cpu_handler, [1])
        cpu = h.cpu_tensors[0]
        assert cpu.shape == (8, 1000)
        for slot, b in enumerate(ids):
            assert cpu[slot, :768].numpy().tobytes() == storage[b, :768].numpy().tobytes()
            assert bool((cpu[slot, 768:] == -1).all())  # padding not copied
        before_pad = storage[:, 768:].clone()
        storage[:, :768] = 0
        h.cpu_to_gpu_handler.transfer_async(2, (spec[1], spec[0]))
        finish(h.cpu_to_gpu_handler, [2])
        assert torch.equal(storage[:, 768:], before_pad)  # GPU padding untouched by loads
        for slot, b in enumerate(ids):
            assert storage[b, :768].numpy().tobytes() == cpu[slot, :768].numpy().tobytes()
    finally:
        h.shutdown()


def test_layers_sharing_storage_share_a_canonical_tensor():
    t = _rand((NB, 16, 4, 8), seed=40)
    kv = from_block_views([[t], [t]], groups=[[0], [1]])
    assert len(kv.tensors) == 1
    assert kv.group_data_refs[0][0].tensor_idx == kv.group_data_refs[1][0].tensor_idx == 0


def test_builder_errors_name_the_problem():
    with pytest.raises(ConfigError, match=r"\(2, num_blocks"):
        kv_first_per_layer([_rand((3, NB, 4))])
    with pytest.raises(ConfigError, match="dense"):
        from_block_views([[_rand((NB, 4, 8)).transpose(1, 2)]])
    with pytest.raises(ConfigError, match="blocks"):
        from_block_views([[_rand((NB, 4))], [_rand((NB + 1, 4))]])
    with pytest.raises(ConfigError, match="group 0 names layer 5"):
        blocks_first_per_layer([_rand((NB, 4))], groups=[[5]])
