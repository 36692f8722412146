"""The model side of bench.ttft: a Llama with random weights, its prefill and greedy decode."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def build_model(tiny: bool, device: torch.device) -> Any:
    """Llama-3.1-8B's shape in bf16 on the GPU, or a tiny Llama in fp32 on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        config = LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096,
        )  # fmt: skip
        dtype = torch.float32
    else:
        config = LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
            rope_theta=500000.0, max_position_embeddings=131072,
        )  # fmt: skip
        dtype = torch.bfloat16
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.inference_mode()
def forward(model: Any, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """Last position's logits of ``ids`` appended to ``cache``."""
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


@torch.inference_mode()
def greedy(model: Any, cache: Any, first_logits: torch.Tensor, steps: int) -> list[int]:
    """``steps`` greedy tokens, the first from ``first_logits`` (the cache grows)."""
    token = int(first_logits.argmax())
    tokens = [token]
    device = first_logits.device
    for _ in range(steps - 1):
        logits = forward(model, torch.tensor([[token]], device=device), cache)
        token = int(logits.argmax())
        tokens.append(token)
    return tokens


def median_time(
    run: Callable[[], Any], reps: int, device: torch.device, before: Callable[[], None] | None
) -> tuple[float, list[float], Any]:
    """Median seconds of ``run`` over ``reps`` (after one warm-up), every time, last result."""
    times = []
    result = None
    for i in range(reps + 1):
        if before is not None:
            before()
        sync(device)
        start = time.perf_counter()
        result = run()
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2], times, result


def copy_floor(nbytes: int, device: torch.device, reps: int) -> float:
    """Median seconds of one bare pinned host->device copy of ``nbytes`` (host memcpy on the
    CPU backend)."""
    pin = device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds, _, _ = median_time(lambda: dst.copy_(src, non_blocking=pin), reps, device, None)
    return seconds
