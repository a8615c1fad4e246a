"""What `plan` reads (pipeline/cluster/measured.json), written only when asked (--save) and
only from several runs: one noisy run on a shared VM must not move the plan's node counts.

Each number is the median of the runs, and `spread` keeps each number's lowest and highest, so
a reader sees how far one run may stray. Nested figures (cpu_ms_per_note_large) are taken key
by key.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable

from pipeline.cluster.plan import MEASURED

MIN_RUNS = 3


def run(bench: str, parser: argparse.ArgumentParser, once: Callable[[argparse.Namespace], dict],
        smoke: dict, min_runs: int = MIN_RUNS) -> None:
    """The benchmark's main: `--runs` times `once`, a JSON line each; with `--save`, their medians.
    `min_runs` 1 only for a bench whose figures are each a mean over a whole day's accounts."""
    parser.add_argument("--runs", type=int, default=1, help="run it this many times; each prints its JSON line")
    parser.add_argument("--save", action="store_true", help=f"write the runs' medians to measured.json ({min_runs}+ runs)")
    args = with_smoke(parser, smoke)
    if args.save and (args.runs < min_runs or args.smoke):
        parser.error(f"--save needs --runs {min_runs} or more, at the bench's own sizes")
    results = []
    for _ in range(args.runs):
        results.append(once(args))
        print(json.dumps(results[-1]), flush=True)
    if args.save:
        print(json.dumps({"saved": str(MEASURED), **save(bench, results, min_runs)}))


def with_smoke(parser: argparse.ArgumentParser, sizes: dict) -> argparse.Namespace:
    """The arguments, with `--smoke`: sizes the test command runs in seconds (tests/test_benches.py),
    so a refactor cannot break a benchmark unseen. Its figures mean nothing."""
    said = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in sizes.items())
    parser.add_argument("--smoke", action="store_true", help=f"the tests' size ({said}): it runs, its figures mean nothing")
    args = parser.parse_args()
    if args.smoke:
        for name, value in sizes.items():
            setattr(args, name, value)
    return args


def median(results: list[dict]) -> tuple[dict, dict]:
    """The runs' medians, and each number's [lowest, highest]."""
    middle, spread = {}, {}
    for key, first in results[0].items():
        values = [r[key] for r in results]
        if isinstance(first, dict):
            middle[key], inner = median(values)
            spread.update({f"{key}.{k}": v for k, v in inner.items()})
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            middle[key] = round(statistics.median(values), 3)
            spread[key] = [min(values), max(values)]
        else:
            middle[key] = first
    return middle, spread


def save(bench: str, results: list[dict], min_runs: int = MIN_RUNS) -> dict:
    if len(results) < min_runs:
        raise SystemExit(f"--save needs --runs {min_runs} or more: the plan follows a median, not one run")
    middle, spread = median(results)
    saved = json.loads(MEASURED.read_text()) if MEASURED.exists() else {}
    entry = {**middle, "runs": len(results)} | ({"spread": spread} if len(results) > 1 else {})  # one run: no spread
    MEASURED.write_text(json.dumps({**saved, bench: entry}, indent=1, sort_keys=True) + "\n")
    return entry
