"""Is a change worth it? ``bench.serving`` on two trees of the library, in alternating processes.

On the lent H200 machines the host's single-thread speed moves within seconds and differs
several-fold from one machine to the next (docs/transfers.md, "How to measure a change"), and
small jobs follow it: a change measured in one run against its base measured in another run
compares the hosts more than the code. This runs the same ``bench.serving`` command on the
base tree (``--base REV``) and on this working tree in turns, one process each, the order of
the trees and of the layouts reversed every round, and reports each measure's median per
tree and in how many rounds the change was ahead.

Both trees run this tree's ``bench`` package (the measurement is the same code); only the
library differs. The base gets this tree's compiled extensions where their sources are the
same in both, else it is built (``setup.py build_ext --inplace``); a tree without compiled
extensions compares with a base without them.

    python -m bench.ab --base HEAD~1 --rounds 3 --layouts tp4_70b,llama8b -- \\
        --device cuda --reps 100 --stream-s 1.0
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench._common import write_json

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("kvcache_offload", "api")
"""What differs between the two trees (``bench`` is always this tree's)."""
BUILD_FILES = ("setup.py", "pyproject.toml", "MANIFEST.in", "mypyc.ini", "README.md")
C_SOURCES = (
    "kvcache_offload/dataplane/copy/_hostcopy.c",
    "kvcache_offload/dataplane/copy/_kernel_issue.c",
    "kvcache_offload/control/policies/_native_duel.c",
    "kvcache_offload/dataplane/copy/_units.h",
)
TREES = ("base", "new")


class ABError(RuntimeError):
    """The base tree could not be made, or a run failed."""


def _git(*args: str, cwd: Path = ROOT) -> bytes:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        raise ABError(f"git {' '.join(args)} failed: {detail.decode(errors='replace')}") from exc


def compiled_sources() -> list[str]:
    """The files the compiled extensions are built from (mypyc's modules and the C ones)."""
    from kvcache_offload._compiled import COMPILED_MODULES

    return [m.replace(".", "/") + ".py" for m in COMPILED_MODULES] + list(C_SOURCES)


def built_extensions(root: Path = ROOT) -> list[Path]:
    """This tree's built extensions, relative to ``root`` (none: a pure-Python tree)."""
    found = [p for d in LIBRARY for p in (root / d).rglob("*.so")]
    found += list(root.glob("*__mypyc*.so"))
    return sorted(p.relative_to(root) for p in found)


def make_base(rev: str, dest: Path) -> str:
    """The library of ``rev`` in ``dest`` with this tree's ``bench``, and extensions matching
    this tree's build; returns how the extensions were provided."""
    _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    present = set(_git("ls-tree", "--name-only", rev).decode().split("\n"))
    if "kvcache_offload" not in present:
        raise ABError(f"{rev} holds no kvcache_offload package")
    wanted = [name for name in (*LIBRARY, *BUILD_FILES) if name in present]
    archive = _git("archive", "--format=tar", rev, *wanted)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    shutil.copytree(ROOT / "bench", dest / "bench", ignore=shutil.ignore_patterns("out"))
    extensions = built_extensions()
    if not extensions:
        return "none (this tree runs its sources)"
    same = all(
        (dest / src).is_file() and (dest / src).read_bytes() == (ROOT / src).read_bytes()
        for src in compiled_sources()
    )
    if same:
        for rel in extensions:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
        return f"copied from this tree ({len(extensions)} files: same sources)"
    if not (dest / "setup.py").is_file():
        raise ABError(
            f"{rev} has other extension sources than this tree and no setup.py to build them"
        )
    built = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=dest,
        capture_output=True,
        text=True,
    )
    if built.returncode != 0 or not built_extensions(dest):
        raise ABError(f"building the base's extensions failed:\n{built.stderr[-2000:]}")
    return f"built for the base ({len(built_extensions(dest))} files)"


def run_serving(tree: Path, layout: str, out: Path, extra: Sequence[str]) -> dict[str, Any]:
    """One ``bench.serving`` process over ``tree``'s library; its report of ``layout``."""
    path = os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "bench.serving", "--layouts", layout, "--mechanisms", "auto",
           "--passes", "1", *extra, "--out", str(out)]  # fmt: skip
    with tempfile.TemporaryDirectory() as cwd:  # not a tree: python -m puts its cwd first
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise ABError(f"{' '.join(cmd)} failed in {tree}:\n{done.stderr[-3000:]}")
    (report,) = json.loads(out.read_text())["layouts"]
    return report


@dataclass
class Row:
    layout: str
    measure: str
    unit: str
    base: float
    new: float
    new_ahead: int | None
    """Rounds in which the new tree did better (None: a measure of the host, not the code)."""
    rounds: int
    per_round: list[tuple[float, float]]
    """(base, new) of each round, in round order."""


HIGHER, LOWER, NEITHER = 1, -1, 0
"""Which way a measure is better; the host probe is neither (it measures the host)."""


def _measures(report: dict[str, Any]) -> Iterable[tuple[str, str, float, int]]:
    """(measure, unit, value, which way is better) of one ``bench.serving`` report."""
    for s in report["single"]:
        name = f"{s['direction']} {s['blocks']}"
        yield name, "us over floor", (s["p50_s"] - s["floor_p50_s"]) * 1e6, LOWER
        yield name, "x floor", s["ratio_p50"], LOWER
        if s.get("copy_p50_s"):  # what the host and the completion path add to the copy
            yield name, "us over copy", (s["p50_s"] - s["copy_p50_s"]) * 1e6, LOWER
            yield name, "copy us", s["copy_p50_s"] * 1e6, LOWER
    for s in report.get("paced", ()):  # 1-block jobs after the loop idled (a lone request)
        name = f"{s['direction']} 1 paced"
        yield name, "us over floor", (s["p50_s"] - s["floor_p50_s"]) * 1e6, LOWER
    for s in report["streams"]:
        yield s["stream"], "share of link", s["ratio_to_one_way_bulk"], HIGHER
        yield s["stream"], "CPU us/job", s["cpu_s_per_job"] * 1e6, LOWER
        yield s["stream"], "p99 / bound", s["p99_s"] / s["p99_bound_s"], LOWER
        yield s["stream"], "host probe us", s["host_probe_s"] * 1e6, NEITHER


def summarize(runs: dict[tuple[str, str, int], dict[str, Any]]) -> list[Row]:
    """Rows from ``{(tree, layout, round): report}``; rounds missing a tree are left out."""
    values: dict[tuple[str, str, str], dict[str, dict[int, float]]] = {}
    better: dict[tuple[str, str, str], int] = {}
    for (tree, layout, rnd), report in runs.items():
        for measure, unit, value, up in _measures(report):
            key = (layout, measure, unit)
            values.setdefault(key, {t: {} for t in TREES})[tree][rnd] = value
            better[key] = up
    rows = []
    for key, by_tree in values.items():
        rounds = sorted(set(by_tree["base"]) & set(by_tree["new"]))
        if not rounds:
            continue
        pairs = [(by_tree["base"][r], by_tree["new"][r]) for r in rounds]
        way = better[key]
        ahead = sum((n - b) * way > 0 for b, n in pairs) if way else None
        base = statistics.median(b for b, _ in pairs)
        new = statistics.median(n for _, n in pairs)
        rows.append(Row(*key, base, new, ahead, len(rounds), pairs))
    return sorted(rows, key=lambda r: (r.layout, r.measure, r.unit))


def schedule(rounds: int, layouts: Sequence[str]) -> list[tuple[int, str, str]]:
    """(round, layout, tree) in run order: both orders reversed every other round."""
    order = []
    for rnd in range(1, rounds + 1):
        flip = rnd % 2 == 0
        for layout in reversed(layouts) if flip else layouts:
            for tree in reversed(TREES) if flip else TREES:
                order.append((rnd, layout, tree))
    return order


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m bench.ab", description=__doc__.split("\n\n")[0],
        epilog="arguments after -- go to bench.serving (e.g. --device cuda --reps 100)",
    )  # fmt: skip
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layouts", default="tp4_70b,llama8b")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    layouts = [name for name in args.layouts.split(",") if name]
    console = Console()
    runs: dict[tuple[str, str, int], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvoffload-ab-") as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        try:
            extensions = make_base(args.base, base)
            trees = {"base": base, "new": ROOT}
            for rnd, layout, tree in schedule(args.rounds, layouts):
                console.print(f"round {rnd}: {layout} on {tree}")
                out = Path(tmp) / f"{tree}-{layout}-{rnd}.json"
                runs[(tree, layout, rnd)] = run_serving(trees[tree], layout, out, extra)
        except ABError as exc:
            console.print(f"[red]{exc}[/red]")
            raise SystemExit(2) from exc
    rows = summarize(runs)
    table = Table(title=f"bench.serving, {args.base} (base) against this tree (new), "
                  f"{args.rounds} rounds; extensions: {extensions}")  # fmt: skip
    for column in ("layout", "measure", "unit", "base", "new", "new ahead"):
        table.add_column(column)
    for r in rows:
        table.add_row(r.layout, r.measure, r.unit, f"{r.base:.2f}", f"{r.new:.2f}",
                      "-" if r.new_ahead is None else f"{r.new_ahead}/{r.rounds}")  # fmt: skip
    console.print(table)
    # The new tree's commit is in write_json's machine info; say whether it was edited.
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no").strip())
    path = write_json("ab", {"base": args.base, "new_uncommitted": dirty, "rounds": args.rounds,
                             "layouts": layouts, "serving_args": extra, "extensions": extensions,
                             "rows": [asdict(r) for r in rows]})  # fmt: skip
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
