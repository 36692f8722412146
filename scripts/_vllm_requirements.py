"""Helpers for scripts/vllm-tests.sh: vLLM's CPU-usable requirements, its unit tests, a platform.

``_vllm_requirements.py SITE``: print the installed vLLM's requirements without the GPU-only ones
(torch family, CUDA kernels and their wrappers), markers evaluated for this interpreter; write
the test-only platform plugin (vLLM's CPU platform) into SITE.
``_vllm_requirements.py --sdist VERSION DEST``: fetch vLLM's source tarball from PyPI (hash
checked) and unpack the OffloadingConnector unit tests and the helpers they import into DEST.
``_vllm_requirements.py --sdist-file VERSION PATH DEST``: the same, for the one file PATH.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import sys
import tarfile
import urllib.request
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement

# Built against CUDA (or the torch pin vLLM names) and unused by the scheduler/connector code.
GPU_ONLY = re.compile(
    r"^(torch|torchaudio|torchvision|torchcodec|flashinfer.*|nvidia-.*|cupy.*|tilelang|"
    r"apache-tvm-ffi|quack-kernels|tokenspeed-mla|humming-kernels|fastsafetensors|"
    r"instanttensor|pynvvideocodec|nvtx|xformers|triton.*|deep.?gemm.*)$",
    re.IGNORECASE,
)

PLATFORM_MODULE = "_kvcache_offload_test_vllm_platform"
PLATFORM_PLUGIN = '''"""Test-only vLLM platform plugin: vLLM's CPU platform on a GPU-less host."""


def cpu_platform() -> str:
    return "vllm.platforms.cpu.CpuPlatform"
'''

# The unit tests and the helper modules they import (paths inside the tarball's tests/).
TEST_PATHS = (
    "tests/v1/kv_connector/unit/offloading_connector/",
    "tests/v1/kv_connector/unit/utils.py",
)


def cpu_requirements() -> list[str]:
    out = []
    for line in requires("vllm") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if GPU_ONLY.match(req.name):
            continue
        req.marker = None
        out.append(str(req))
    return out


def write_platform_plugin(site: Path) -> None:
    (site / f"{PLATFORM_MODULE}.py").write_text(PLATFORM_PLUGIN)
    dist = site / f"{PLATFORM_MODULE.strip('_')}-0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {PLATFORM_MODULE.strip('_')}\nVersion: 0\n"
    )
    (dist / "entry_points.txt").write_text(
        f"[vllm.platform_plugins]\nkvcache_offload_test_cpu = {PLATFORM_MODULE}:cpu_platform\n"
    )
    (dist / "RECORD").write_text("")


def fetch_sdist_tests(version: str, dest: Path, paths: tuple[str, ...] = TEST_PATHS) -> None:
    """vLLM's source tarball from PyPI (hash checked); its files under ``paths`` into ``dest``."""
    request = urllib.request.Request(
        "https://pypi.org/simple/vllm/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        index = json.load(resp)
    name = f"vllm-{version}.tar.gz"
    entry = next((f for f in index["files"] if f["filename"] == name), None)
    if entry is None:
        raise SystemExit(f"PyPI has no {name}")
    with urllib.request.urlopen(entry["url"], timeout=300) as resp:
        data = resp.read()
    if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
        raise SystemExit(f"{name}: sha256 mismatch")
    prefix = f"vllm-{version}/"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = []
        for member in tar.getmembers():
            rel = member.name.removeprefix(prefix)
            if member.isfile() and rel.startswith(paths):
                member.name = rel
                members.append(member)
        tar.extractall(dest, members=members, filter="data")
    # Package markers for the test modules' "tests.v1..." imports; vLLM's top-level conftest
    # (model downloads, GPU fixtures) is deliberately not taken.
    for pkg in ("tests", "tests/v1", "tests/v1/kv_connector", "tests/v1/kv_connector/unit"):
        (dest / pkg).mkdir(parents=True, exist_ok=True)
        (dest / pkg / "__init__.py").touch()


def main(argv: list[str]) -> None:
    if argv[:1] == ["--sdist"]:
        fetch_sdist_tests(argv[1], Path(argv[2]))
        return
    if argv[:1] == ["--sdist-file"]:  # one file of the tarball (scripts/vllm-gpu-bundle.sh)
        fetch_sdist_tests(argv[1], Path(argv[3]), (argv[2],))
        return
    write_platform_plugin(Path(argv[0]))
    print("\n".join(cpu_requirements()))


if __name__ == "__main__":
    main(sys.argv[1:])
