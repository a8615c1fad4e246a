"""Building a note's data (issue 73: at most 15 µs a trade), ours beside the code before it, same run.

What is timed is the render task's own `pipeline.stages.note_data`: shard rows to Trades, the
charges, the note's data (every value a finished string). Two sizes:

  typical_us_per_trade     CPU µs a trade over notes of 20 trades each (one in ten also trading
                           currency, commodities and BSE's index options, as bench/render.py's)
  pages_2000_us_per_trade  CPU µs a trade for one note of 2,000 pages (125,416 trades, seed 7:
                           bench/render.py's pages_2000 note, the volatile client's size)
  pages_2000_build_s       that note's CPU seconds, ours

and each again as `baseline_...`: the same rows through `note_data` of BASELINE (the tree before
this work, taken out of git into a temporary directory), and `..._speedup` (baseline / ours).
Each row runs in a process of its own, ours and the baseline taking turns (this VM's speed
drifts within a minute: a ratio is taken within a turn); a figure is the median of the turns,
`_spread` the turns' lowest and highest. `identical` says the two trees' note data hash the same
for every note timed (sha256 of the JSON), which is the point: the money is not allowed to move.

    python bench/note_data.py [--notes 500] [--pages 2000] [--turns 3] [--baseline REV]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_US = 15.0
BASELINE = "4ccda34acde9e661b3dea17618b32b2d54d5d09d"  # main before the note data work (every segment's charges in)
TYPICAL_TRADES = 20


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from bench import measured

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--notes", type=int, default=500, help=f"typical notes of {TYPICAL_TRADES} trades")
    parser.add_argument("--pages", type=int, default=2000, help="the huge note's pages (0: not timed)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--baseline", default=BASELINE, help="the git revision timed beside ours ('': none)")
    args = measured.with_smoke(parser, {"notes": 5, "pages": 2, "turns": 1})
    with tempfile.TemporaryDirectory(prefix="cn-notedata") as tmp:
        trees = {"": ROOT}
        if args.baseline:
            trees["baseline_"] = Path(tmp) / "baseline"
            _checkout(args.baseline, trees["baseline_"])
        sizes = {"typical": _rows_file(tmp, "typical", _typical(args.notes))}
        if args.pages:
            sizes["pages_2000"] = _rows_file(tmp, "huge", _huge(args.pages))
        runs: dict[str, list[dict]] = {f"{tree}{size}": [] for tree in trees for size in sizes}
        for _ in range(args.turns):
            for size, rows in sizes.items():
                for tree, path in trees.items():
                    runs[f"{tree}{size}"].append(_run(path, rows))
    result: dict = {"target_us_per_trade": TARGET_US, "baseline": args.baseline or None, "turns": args.turns}
    for size in sizes:
        ours = [r["cpu_us_per_trade"] for r in runs[size]]
        result[f"{size}_us_per_trade"] = round(statistics.median(ours), 2)
        result[f"{size}_us_per_trade_spread"] = [round(min(ours), 2), round(max(ours), 2)]
        result[f"{size}_trades"] = runs[size][0]["trades"]
        if size == "pages_2000":
            result["pages_2000_build_s"] = round(statistics.median(r["cpu_s"] for r in runs[size]), 2)
            result["pages_2000_build_wall_s"] = round(statistics.median(r["wall_s"] for r in runs[size]), 2)
        if args.baseline:
            theirs = [r["cpu_us_per_trade"] for r in runs[f"baseline_{size}"]]
            result[f"baseline_{size}_us_per_trade"] = round(statistics.median(theirs), 2)
            ratios = [b / o for b, o in zip(theirs, ours)]
            result[f"{size}_speedup"] = round(statistics.median(ratios), 2)
            result[f"{size}_speedup_spread"] = [round(min(ratios), 2), round(max(ratios), 2)]
    if args.baseline:
        result["identical"] = all(r["sha256"] == runs[f"baseline_{key}"][i]["sha256"]
                                  for key in sizes for i, r in enumerate(runs[key]))
    result["meets_target"] = all(result[f"{size}_us_per_trade"] <= TARGET_US for size in sizes)
    print(json.dumps(result))


def _typical(notes: int) -> list[list[list[str]]]:
    from bench.render import trades

    return [[t.as_row() for t in trades(TYPICAL_TRADES, seed=i)] for i in range(notes)]


def _huge(pages: int) -> list[list[list[str]]]:
    from bench.render import trades
    from pipeline.note.content import ROWS_PER_PAGE

    return [[t.as_row() for t in trades(pages * ROWS_PER_PAGE, seed=7)]]  # as a shard file holds them


def _rows_file(tmp: str, name: str, notes: list) -> Path:
    path = Path(tmp) / f"{name}.json"
    path.write_text(json.dumps(notes))
    return path


def _checkout(rev: str, into: Path) -> None:
    """The revision's pipeline package (pure Python where a note's data is built) and its templates
    (the broker's details) out of git."""
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "pipeline", "templates"], capture_output=True,
                             check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)


def _run(tree: Path, rows: Path) -> dict:
    done = subprocess.run([sys.executable, __file__, "--worker", str(tree), str(rows)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the worker on {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def worker(tree: str, rows: str) -> dict:
    """Each note's data built from its rows by `tree`'s note_data, after a warm-up note (imports,
    the rates' and the broker's caches): the CPU seconds, and the hash of every note built."""
    sys.path.insert(0, tree)
    from pipeline.day import trading_calendar
    from pipeline.day.dumps import Client
    from pipeline.stages import note_data

    assert Path(sys.modules["pipeline"].__file__).is_relative_to(tree), "the worker imported another tree's pipeline"
    trade_date = "2026-11-20"  # bench/render.py's day and client
    client = Client("C0000042", "Aarav Iyer", "ABCPD1234E", "c42@example.com", "12, MG Road, Mumbai",
                    "Maharashtra", "27", True)
    settles = trading_calendar.settlement_dates(trade_date)
    notes = [{"trades": r, "note_no": f"CNT-26/27-{i:07d}"} for i, r in enumerate(json.loads(Path(rows).read_text()))]
    trades = sum(len(n["trades"]) for n in notes)
    note_data({**notes[0], "trades": notes[0]["trades"][:TYPICAL_TRADES]}, client, trade_date, settles)
    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    built = [note_data(n, client, trade_date, settles) for n in notes]
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    digest = hashlib.sha256()
    for note in built:
        digest.update(json.dumps(note, sort_keys=True).encode())
    return {"trades": trades, "cpu_s": cpu, "wall_s": wall, "cpu_us_per_trade": cpu / trades * 1e6,
            "sha256": digest.hexdigest()}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:  # before anything imports a pipeline package: the tree's is the one timed
        print(json.dumps(worker(*sys.argv[2:4])))
    else:
        main()
