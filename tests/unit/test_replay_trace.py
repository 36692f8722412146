"""Trace readers: both formats, interning, and clear errors naming the bad line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcache_offload import make_offload_key
from kvcache_offload.lab.trace import (
    TraceFormatError,
    default_trace_paths,
    iter_requests,
    load_trace,
    mooncake_key,
    sample_trace_path,
)


def _write(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_mooncake_key_matches_make_offload_key() -> None:
    for h in (0, 7, 123456789):
        assert mooncake_key(h) == make_offload_key(str(h).encode(), 0)


def test_mooncake_lines_become_requests_with_shared_key_objects(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 12, "input_length": 600, "output_length": 7, "hash_ids": [0, 2]},
        ],
    )
    trace = load_trace(path)
    assert trace.num_requests == 2
    assert trace.num_block_accesses == 4
    assert trace.num_unique_blocks == 3
    assert trace.block_ids == [[0, 1], [0, 2]]
    assert trace.input_lengths == [1000, 600]
    assert trace.output_lengths == [5, 7]
    assert trace.timestamps == [0.0, 12.0]
    assert trace.keys[0][0] is trace.keys[1][0]  # interned: one bytes object per block
    assert trace.keys[1] == [mooncake_key(0), mooncake_key(2)]
    assert trace.infinite_cache_hit_rate() == pytest.approx(1 / 4)


def test_recorded_log_merges_store_into_its_lookup_by_request_id(tmp_path: Path) -> None:
    a, b, c = (make_offload_key(bytes([i]) * 8, 0).hex() for i in (1, 2, 3))
    path = _write(
        tmp_path / "rec.jsonl",
        [
            {"ts": 1.0, "op": "lookup", "keys": [a, b], "req": "r1"},
            {"ts": 1.5, "op": "lookup", "keys": [a], "req": "r2"},
            {"ts": 2.0, "op": "store", "keys": [b, c], "req": "r1"},
            {"ts": 3.0, "op": "store", "keys": [c]},
        ],
    )
    requests = list(iter_requests(path))
    assert [[k.hex() for k in r.keys] for r in requests] == [[a, b, c], [a], [c]]
    assert requests[0].input_length == 3 * 512
    assert requests[0].ts == 1.0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"foo": 1}, "unknown record"),
        ({"timestamp": 0, "input_length": 10, "hash_ids": "12"}, "'hash_ids' must be a list"),
        ({"timestamp": 0, "input_length": 10, "hash_ids": [1, "x"]}, "non-negative integers"),
        ({"timestamp": 0, "input_length": -1, "hash_ids": [1]}, "'input_length'"),
        ({"timestamp": "soon", "input_length": 1, "hash_ids": [1]}, "'timestamp'"),
        ({"ts": 0, "op": "lookup", "keys": [1, 2]}, "'keys' must hold hex strings"),
    ],
)
def test_malformed_line_names_file_and_line_number(
    tmp_path: Path, line: object, message: str
) -> None:
    good = {"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0]}
    if isinstance(line, dict) and "op" in line:
        good = {"ts": 0, "op": "lookup", "keys": [make_offload_key(b"k", 0).hex()]}
    path = _write(tmp_path / "bad.jsonl", [good, "", line])
    with pytest.raises(TraceFormatError, match=rf"bad\.jsonl:3: .*{message}"):
        load_trace(path)


def test_recorded_errors_name_the_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "r.jsonl", [{"ts": 0, "op": "evict", "keys": []}])
    with pytest.raises(TraceFormatError, match=r"r\.jsonl:1: 'op' must be"):
        load_trace(path)
    path = _write(tmp_path / "s.jsonl", [{"ts": 0, "op": "lookup", "keys": ["0011"]}])
    with pytest.raises(TraceFormatError, match=r"s\.jsonl:1: key '0011' is too short"):
        load_trace(path)


def test_mixing_formats_in_one_file_is_rejected(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "mixed.jsonl",
        [
            {"timestamp": 0, "input_length": 512, "hash_ids": [0]},
            {"ts": 0, "op": "lookup", "keys": [make_offload_key(b"k", 0).hex()]},
        ],
    )
    with pytest.raises(TraceFormatError, match=r"mixed\.jsonl:2: recorded record in a mooncake"):
        load_trace(path)


def test_shipped_sample_is_a_prefix_chained_mooncake_slice() -> None:
    trace = load_trace(sample_trace_path())
    assert trace.num_requests == 2000
    assert trace.num_unique_blocks == 38_788
    # Chained ids: every id always has the same predecessor.
    parent: dict[int, int] = {}
    for ids in trace.block_ids:
        for prev, cur in zip([-1, *ids], ids, strict=False):
            assert parent.setdefault(cur, prev) == prev


def test_default_trace_paths_fall_back_to_the_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCACHE_OFFLOAD_TRACE_DIR", str(tmp_path))
    assert default_trace_paths() == [sample_trace_path()]
    (tmp_path / "mooncake_synthetic_trace.jsonl").write_text("")
    assert default_trace_paths() == [tmp_path / "mooncake_synthetic_trace.jsonl"]


def test_synthetic_trace_is_seeded_chained_and_shares_prefixes(tmp_path: Path) -> None:
    from kvcache_offload.lab.synth import (
        main,
        synth_requests,
    )

    assert synth_requests(200, seed=5) == synth_requests(200, seed=5)
    assert synth_requests(200, seed=5) != synth_requests(200, seed=6)
    out = tmp_path / "s.jsonl"
    main([str(out), "--requests", "300", "--seed", "2"])
    trace = load_trace(out)
    assert trace.num_requests == 300
    assert 0.2 < trace.infinite_cache_hit_rate() < 0.95
    parent: dict[int, int] = {}
    for ids, length in zip(trace.block_ids, trace.input_lengths, strict=True):
        assert len(ids) == -(-length // 512)
        for prev, cur in zip([-1, *ids], ids, strict=False):
            assert parent.setdefault(cur, prev) == prev


def test_gzip_compressed_traces_are_read(tmp_path: Path) -> None:
    import gzip

    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(json.dumps({"timestamp": 0, "input_length": 600, "hash_ids": [3, 4]}) + "\n")
    trace = load_trace(path)
    assert trace.num_block_accesses == 2
    assert trace.name == "t.jsonl.gz"


def test_without_partial_blocks_drops_only_the_partial_tail() -> None:
    from kvcache_offload.lab.trace import (
        TraceRequest,
        trace_from_requests,
    )

    trace = trace_from_requests(
        [
            TraceRequest(0.0, 1100, 30, [mooncake_key(h) for h in (1, 2, 3)]),  # 2 full + 76
            TraceRequest(1.0, 1024, 40, [mooncake_key(h) for h in (1, 2)]),  # exactly 2 full
        ]
    )
    full = trace.without_partial_blocks()
    assert full.block_ids == [[0, 1], [0, 1]]
    assert full.num_unique_blocks == 2
    assert full.input_lengths == [1100, 1024]
    assert full.output_lengths == [30, 40]
    assert trace.num_unique_blocks == 3  # the original is untouched
