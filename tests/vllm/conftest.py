"""Shared set-up for the tests against vLLM's own code (run by scripts/vllm-tests.sh).

vLLM reads a model config (and, for structured output, a tokenizer) even when no model runs:
a made-up OPT-like model is written into a fresh Hugging Face cache and the hub is switched
offline before vLLM is imported. Without vLLM installed every test here is skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

MODEL = "facebook/opt-125m"
"""The repo id vLLM's own test helpers default to; served from the local cache only."""

_SNAPSHOT = "0" * 40
_cache_dir: str | None = None


def _write_model(hub: Path) -> None:
    repo = hub / ("models--" + MODEL.replace("/", "--"))
    snapshot = repo / "snapshots" / _SNAPSHOT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(_SNAPSHOT)
    config = {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": 64,
        "word_embed_proj_dim": 64,
        "ffn_dim": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 512,
        "max_position_embeddings": 16384,
        "do_layer_norm_before": True,
        "torch_dtype": "float16",
        "bos_token_id": 2,
        "eos_token_id": 2,
        "pad_token_id": 1,
    }
    (snapshot / "config.json").write_text(json.dumps(config))
    (snapshot / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 1, "</s>": 2, "<unk>": 3} | {f"t{i}": i for i in range(4, 512)}
    vocab["<s>"] = 0
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(snapshot / "tokenizer.json"))
    (snapshot / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "model_max_length": 16384,
            }
        )
    )


def pytest_configure(config: pytest.Config) -> None:
    global _cache_dir
    if importlib.util.find_spec("vllm") is None:
        return
    _cache_dir = tempfile.mkdtemp(prefix="kvcache-offload-hf-")
    _write_model(Path(_cache_dir) / "hub")
    os.environ["HF_HOME"] = _cache_dir
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def pytest_unconfigure(config: pytest.Config) -> None:
    if _cache_dir is not None:
        shutil.rmtree(_cache_dir, ignore_errors=True)
