"""A worker process for the shared-region tests: maps a region, then obeys stdin commands.

Usage: python -m tests.integration._region_worker '<json>' with keys name, num_blocks,
cpu_page_size, num_workers, rank, shm_dir. Prints one JSON line per event.
Commands: "write" (fill own cells), "check r1 r2 ..." (verify those ranks' cells), "exit".
"""

from __future__ import annotations

import json
import sys

import numpy as np


def pattern(rank: int, num_blocks: int, page: int) -> np.ndarray:
    blocks = np.arange(num_blocks, dtype=np.int64)[:, None]
    cols = np.arange(page, dtype=np.int64)[None, :]
    return ((rank * 31 + blocks * 7 + cols) % 251 + 1).astype(np.uint8)


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


def main() -> int:
    args = json.loads(sys.argv[1])
    from kvcache_offload.dataplane.memory.shared_offload_region import SharedOffloadRegion
    from kvcache_offload.errors import RegionError

    try:
        region = SharedOffloadRegion(
            args["name"],
            num_blocks=args["num_blocks"],
            cpu_page_size=args["cpu_page_size"],
            num_workers=args["num_workers"],
            rank=args["rank"],
            shm_dir=args["shm_dir"],
            timeout_s=args.get("timeout_s", 20.0),
        )
    except RegionError as exc:
        say(event="error", type=type(exc).__name__, message=str(exc))
        return 0
    say(event="mapped", creator=region.is_creator, sealed=region.sealed)
    page, nb = region.cpu_page_size, region.num_blocks
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "write":
            rows = region.rows_array()
            r = args["rank"]
            rows[:, r * page : (r + 1) * page] = pattern(r, nb, page)
            del rows
            say(event="written")
        elif cmd[0] == "check":
            rows = region.rows_array()
            bad = [
                int(r)
                for r in cmd[1:]
                if not np.array_equal(
                    rows[:, int(r) * page : (int(r) + 1) * page], pattern(int(r), nb, page)
                )
            ]
            del rows
            say(event="checked", bad=bad)
        elif cmd[0] == "exit":
            region.cleanup()
            say(event="bye")
            return 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
