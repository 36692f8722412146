"""Transfer metrics count every byte moved into or out of the CPU tier, whoever copied it."""

from __future__ import annotations

from tests.unit._api_app import BLOCK_BYTES, hex_key, served


async def test_remote_block_writes_and_reads_count_as_store_and_load_transfers() -> None:
    async with served() as s:
        put = await s.client.put(
            "/v1/blocks",
            params=[("keys", hex_key(1)), ("keys", hex_key(2))],
            content=b"\x07" * (2 * BLOCK_BYTES),
        )
        assert put.status_code == 200, put.text
        got = await s.client.get(f"/v1/blocks/{hex_key(1)}")
        assert got.status_code == 200 and got.content == b"\x07" * BLOCK_BYTES
        stats = s.engine.stats()
        assert stats.transfer_bytes["gpu_to_cpu"] == 2 * BLOCK_BYTES
        assert stats.transfer_bytes["cpu_to_gpu"] == BLOCK_BYTES
        assert stats.transfer_duration["gpu_to_cpu"].count == 1
        assert stats.transfer_duration["cpu_to_gpu"].count == 1


async def test_sidecar_clients_report_their_own_copies() -> None:
    async with served() as s:
        lease = (await s.client.post("/v1/store/prepare", json={"keys": [hex_key(3)]})).json()
        done = await s.client.post(
            "/v1/store/complete",
            json={"lease_id": lease["lease_id"], "transfer_bytes": 4096, "transfer_seconds": 0.002},
        )
        assert done.status_code == 200, done.text
        load = (await s.client.post("/v1/load/prepare", json={"keys": [hex_key(3)]})).json()
        done = await s.client.post(
            "/v1/load/complete",
            json={"lease_id": load["lease_id"], "transfer_bytes": 4096, "transfer_seconds": 0.001},
        )
        assert done.status_code == 200, done.text
        stats = s.engine.stats()
        assert stats.transfer_bytes == {"gpu_to_cpu": 4096, "cpu_to_gpu": 4096}
        assert stats.transfer_seconds["gpu_to_cpu"] == 0.002
        metrics = (await s.client.get("/metrics")).text
        assert 'kvcache_offload_transfer_bytes_total{direction="gpu_to_cpu"} 4096.0' in metrics


async def test_a_negative_copy_report_is_rejected_and_the_lease_stays_open() -> None:
    async with served() as s:
        lease = (await s.client.post("/v1/store/prepare", json={"keys": [hex_key(4)]})).json()
        bad = await s.client.post(
            "/v1/store/complete", json={"lease_id": lease["lease_id"], "transfer_bytes": -1}
        )
        assert bad.status_code == 422
        ok = await s.client.post("/v1/store/complete", json={"lease_id": lease["lease_id"]})
        assert ok.status_code == 200
        assert s.engine.stats().transfer_bytes["gpu_to_cpu"] == 0
