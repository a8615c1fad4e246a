"""Rendering speed and size, ours against a naive per-cell table() template, one run.

  typical_note_ms         CPU ms per note of 3-20 trades (different notes, warm compiler), rendered
                          as a render task does a shard's (render_all: compiled together, cut apart)
  dense_page_ms           CPU ms per full page of trades
  pages_2000_wall_s       wall seconds from a shard's trade rows to one merged PDF of about
                          2000 pages: parsing, charges, note data, page ranges rendered in
                          parallel on local Ray, merge (the render task's note_data and render_notes)
  pages_2000_cpu_s        every core's busy seconds (/proc/stat) over those wall seconds: every
                          process's CPU, Ray's own too (the machine to itself: anything else counts)
  pages_2000_peak_rss_mb  the largest peak RSS of any process doing that work (the note's in a process
                          of its own that first renders typical notes, as a render worker has)
  pages_2000_range_task_s, pages_2000_range_tasks_sum_s, pages_2000_submit_s, pages_2000_merge_s
                          its page ranges (fastest and slowest, all together), the ranges cut and
                          handed to Ray, the merge: the parts of the one below
  pages_2000_ranges_here  of pages_2000_range_tasks, those the render task rendered itself (no
                          task had started them when it had compiled its other notes)
  pages_2000_on_render_node_s
                          the same note's wall seconds projected on one render node (plan's
                          c6a.8xlarge, cluster.yaml's: 32 vCPUs) from this run's own
                          times: the data built (one process), the ranges cut and handed to Ray (until the last is
                          asked for), each range as timed where it was rendered, by its task or by
                          the render task (bench/range_times.py; in page order, each to the first
                          free vCPU, from the last one asked for: an overestimate), the merge
  typical_pdf_kb          mean size of a typical note
  baseline_typical_note_ms, baseline_dense_page_ms
                          the same notes through bench/baseline_table.typ
  typical_speedup, dense_speedup
                          the baseline's CPU over ours, the median of the turns (each turn
                          ours beside the baseline, each row in a process of its own), and
                          the spread of the turns
Prints one JSON object as its last line.

    python bench/render.py [--pages 2000] [--turns 5]  # --pages 0: the ratios only
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import measured, range_times  # noqa: E402
from bench.e2e import busy_s  # noqa: E402

import typst  # noqa: E402

from pipeline.day import synth, trading_calendar  # noqa: E402
from pipeline.day.dumps import Client, effective_trades, parse_trade  # noqa: E402
from pipeline.note.charges import compute, net_totals  # noqa: E402
from pipeline.note.content import ROWS_PER_PAGE, _cells, build_note  # noqa: E402
from pipeline.note.render import render, render_all  # noqa: E402
from pipeline.stages import broker, note_data  # noqa: E402

TRADE_DATE = "2026-11-20"
CLIENT = Client("C0000042", "Aarav Iyer", "ABCPD1234E", "c42@example.com", "12, MG Road, Mumbai",
                "Maharashtra", "27", True)


def trades(n: int, seed: int):
    """A note's trades; one note in ten also trades currency, commodities and BSE's index options,
    the synthetic day's default share, so the typical note is timed with those sections too."""
    rng = random.Random(seed)
    mix = random.Random(seed + 7919) if seed % 10 == 0 else None
    rows = list(synth._trades(rng, dt.date.fromisoformat(TRADE_DATE), CLIENT.ucc, n, synth._Numbers(rng), mix))
    closes = synth.closing_prices(dt.date.fromisoformat(TRADE_DATE), rows)
    return effective_trades([parse_trade("trades.csv", i, r, TRADE_DATE, closes) for i, r in enumerate(rows, 1)])


def note_for(ts, number: int) -> dict:
    b = broker()
    return build_note(CLIENT, ts, compute(ts, TRADE_DATE, False, b["tariff"]), b, TRADE_DATE,
                      f"CNT-26/27-{number:07d}")


def baseline_data(note: dict, ts) -> dict:
    """The same content as cells, for the per-cell template."""
    charges = compute(ts, TRADE_DATE, False, broker()["tariff"])
    totals, _ = net_totals(ts, charges)
    levies = note["levies"]
    return {
        "broker": note["broker"], "number": note["note"]["number"], "trade_date": note["note"]["trade_date"],
        "client": list(note["client"].items()),
        "heads": ["Order No", "Order Time", "Trade No", "Trade Time", "Security", "B/S", "Qty", "Gross Rate",
                  "Brokerage", "Net Rate", "Closing Rate", "Net Total", "Remarks"],
        "rows": [_cells(t, charges.brokerage_per_unit(t), totals[t.key]) for t in ts],
        "levies": [line.split("  ") for line in [levies["head"], *levies["lines"], levies["net"]]],
    }


ROWS = ["typical_note_ms", "baseline_typical_note_ms", "dense_note_ms", "baseline_dense_note_ms"]


def in_turns(turns: int) -> dict[str, list[float]]:
    """Each row's CPU ms a note in each turn, the rows taking turns, each in a process of its
    own. This VM's speed drifts by tens of percent within a minute: rows timed one after the
    other gave ratios that moved with it, so a ratio is taken within a turn, ours beside its
    baseline. In one process, a row timed after another ran 20-30% off its own pace (Typst's
    memo cache, the heap of the other's compiles), which a render worker never is. Both rows
    compile on the pool a render worker's Typst has (COMPILE_THREADS)."""
    from pipeline.cluster.driver import COMPILE_THREADS

    env = {**os.environ, "RAYON_NUM_THREADS": str(COMPILE_THREADS)}
    runs: dict[str, list[float]] = {row: [] for row in ROWS}
    for _ in range(turns):
        for row in ROWS:
            done = subprocess.run([sys.executable, __file__, "--row", row], capture_output=True, text=True,
                                  check=True, env=env)
            runs[row].append(float(done.stdout.split()[-1]))
    return runs


def one_row(row: str) -> float:
    """CPU ms a note of one row. It first renders 20 typical notes it does not time: Typst
    memoises the last 10 compiles, and a note seen in them renders almost for free."""
    typical_trades, typical = corpus(120)
    timed_trades, timed = (typical_trades[20:], typical[20:]) if "typical" in row else dense_corpus()
    if row.startswith("baseline"):
        baseline = typst.Compiler(str(ROOT / "bench" / "baseline_table.typ"), root=str(ROOT))
        fn = lambda data: baseline.compile(format="pdf", sys_inputs={"note": json.dumps(data)},  # noqa: E731
                                           pdf_tags=False)
        typical = [baseline_data(n, ts) for n, ts in zip(typical, typical_trades)]
        timed = [baseline_data(n, ts) for n, ts in zip(timed, timed_trades)]
        for item in typical[:20]:
            fn(item)
        started = time.process_time()
        for item in timed:
            fn(item)
    else:
        render_all(typical[:20])
        started = time.process_time()
        render_all(timed)
    return (time.process_time() - started) * 1000 / len(timed)


def corpus(n: int) -> tuple[list, list]:
    """Typical notes: 3 to 20 trades."""
    typical_trades = [trades(3 + i % 18, seed=i) for i in range(n)]
    return typical_trades, [note_for(ts, i) for i, ts in enumerate(typical_trades)]


def dense_corpus() -> tuple[list, list]:
    """Three notes of eight full pages of trades (nine pages with the levies)."""
    dense_trades = [trades(ROWS_PER_PAGE * 8, seed=1002 + i) for i in range(3)]
    return dense_trades, [note_for(ts, i) for i, ts in enumerate(dense_trades)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=2000, help="the huge note's pages (0: not rendered)")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)  # one row, in a process of its own
    parser.add_argument("--huge", action="store_true", help=argparse.SUPPRESS)  # the huge note, in one of its own
    args = measured.with_smoke(parser, {"pages": 120, "turns": 1})  # 120: past PARALLEL_FROM_PAGES, in ranges
    if args.row:
        print(one_row(args.row))
        return
    if args.huge:  # in a process of its own: the ratios' corpora and the baseline's memo stay out of its peak
        print(json.dumps(huge(args.pages)))
        return

    _, typical = corpus(120)
    dense_trades, dense = dense_corpus()
    baseline = typst.Compiler(str(ROOT / "bench" / "baseline_table.typ"), root=str(ROOT))
    pages = sum(n["total_pages"] for n in dense)
    base_pages = sum(_pages(baseline.compile(format="pdf", sys_inputs={"note": json.dumps(baseline_data(n, ts))},
                                             pdf_tags=False)) for n, ts in zip(dense, dense_trades))
    runs = in_turns(args.turns)
    per_page = {"dense_note_ms": len(dense) / pages, "baseline_dense_note_ms": len(dense) / base_pages}
    for row, factor in per_page.items():
        runs[row.replace("note", "page")] = [ms * factor for ms in runs.pop(row)]
    result = {row: round(statistics.median(ms), 2) for row, ms in runs.items()}
    result["typical_pdf_kb"] = round(sum(map(len, render_all(typical))) / len(typical) / 1024, 1)
    for kind in ("typical_note", "dense_page"):
        ratios = [b / o for b, o in zip(runs[f"baseline_{kind}_ms"], runs[f"{kind}_ms"])]
        speedup = kind.split("_")[0] + "_speedup"
        result[speedup] = round(statistics.median(ratios), 1)
        result[speedup + "_spread"] = [round(min(ratios), 1), round(max(ratios), 1)]
    if args.pages:
        done = subprocess.run([sys.executable, __file__, "--huge", "--pages", str(args.pages)], capture_output=True,
                              text=True, check=True)
        result.update(json.loads(done.stdout.splitlines()[-1]))
    print(json.dumps(result))


def huge(pages: int) -> dict:
    """Trades to a merged PDF through the product's own note_data and render_notes, in a Ray
    task that holds a render slot as render_task does, on a local Ray of the machine's cores,
    its workers warm. That task first renders 240 typical notes in batches (eleven compiles:
    Typst's memo of the last ten held), as a render worker that has rendered shards has. A
    sampler thread records the peak RSS of every process under this one."""
    import psutil
    import ray

    from pipeline.cluster.driver import RENDER_SLOT, workers_environment
    from pipeline.cluster.page_ranges import RANGE_PAGES
    from pipeline.cluster.plan import RENDER
    from pipeline.settings import ROOT as PROJECT

    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="cn-range-times-") as times:  # each range's times, from its worker
        with workers_environment():  # the allocator and compile threads a run's Ray has
            ray.init(num_cpus=cores, resources={"render": cores}, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"PYTHONPATH": PROJECT, range_times.DIR: times},
                                  "worker_process_setup_hook": "bench.range_times.hook"})
        # A worker a slot, as a render node's are once it has rendered shards. A range on the CPU the
        # render task lends while it waits for the ranges tasks hold needs one more: Ray starts it,
        # as on a node (and stops it a second after it is idle, past a worker a CPU).
        warm = ray.remote(**RENDER_SLOT)(lambda: render(note_for(trades(3, 1), 1)) and None)
        ray.get([warm.remote() for _ in range(cores)])
        peak, busy, stop = {"kb": 0}, [], threading.Event()

        def sample() -> None:
            """The cores' busy time every 50 ms; every 250 ms each live process's peak RSS so far (the
            kernel's VmHWM: a peak between two reads is still seen, unless its process ends before
            the next; the warm-up's count too): reading every process's RSS every 50 ms took 6.5%
            of a core from the note it measured."""
            me = psutil.Process()
            for tick in itertools.count():
                busy.append((time.time(), busy_s()))
                last = stop.is_set()
                if last or tick % 5 == 0:
                    for proc in [me, *me.children(recursive=True)]:
                        peak["kb"] = max(peak["kb"], _peak_kb(proc.pid))
                if last:
                    break
                time.sleep(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        done = ray.get(ray.remote(**RENDER_SLOT)(_volatile_shard).remote(pages))
        stop.set()
        sampler.join()
        started, built, finished = done["started"], done["built"], done["finished"]
        ray.shutdown()
        rendered, asked = range_times.read(times), done["asked"]
    if sorted(rendered) != list(range(0, done["total_pages"], RANGE_PAGES)) or len(asked) != len(rendered):
        raise RuntimeError(f"ranges rendered from pages {sorted(rendered)}, {len(asked)} asked for: "
                           "not each of the note's once")
    ranges = [rendered[first] for first in sorted(rendered)]
    slots = RENDER.vcpus  # a range a vCPU of the render task's node
    submit_s = max(asked) - built  # the ranges cut from the note and handed to Ray
    merge_s = finished - max(end for _, _, end in ranges)
    return {
        "pages_2000_pages": done["pages"],
        "pages_2000_wall_s": round(finished - started, 2),
        "pages_2000_build_s": round(built - started, 2),
        "pages_2000_render_merge_s": round(finished - built, 2),
        "pages_2000_cpu_s": round(_at(busy, finished) - _at(busy, started), 2),
        "pages_2000_pdf_mb": done["pdf_mb"],
        "pages_2000_peak_rss_mb": round(peak["kb"] / 1024),
        "pages_2000_range_tasks": len(ranges),
        "pages_2000_ranges_here": sum(pid == done["pid"] for pid, _, _ in ranges),
        "pages_2000_range_task_s": [round(min(e - b for _, b, e in ranges), 2),
                                    round(max(e - b for _, b, e in ranges), 2)],
        "pages_2000_range_tasks_sum_s": round(sum(e - b for _, b, e in ranges), 2),
        "pages_2000_submit_s": round(submit_s, 2),
        "pages_2000_merge_s": round(merge_s, 2),
        "render_node_slots": slots,
        "pages_2000_on_render_node_s": round(built - started + submit_s
                                             + _makespan([e - b for _, b, e in ranges], slots) + merge_s, 2),
    }


def _volatile_shard(pages: int) -> dict:
    """In a render task's place: the note built from its shard rows and rendered, timed by the
    wall clock (epoch seconds, to set beside the ranges' times and when each was asked for)."""
    from pipeline.cluster.page_ranges import render_notes

    _, typical = corpus(240)
    render_all(typical)
    del typical
    rows = [t.as_row() for t in trades(pages * ROWS_PER_PAGE, seed=7)]  # as a shard file holds them
    started = time.time()
    note = note_data({"trades": rows, "note_no": "CNT-26/27-0000001"}, CLIENT, TRADE_DATE,
                     trading_calendar.settlement_dates(TRADE_DATE))
    built = time.time()
    [pdf] = render_notes([note])
    finished = time.time()
    return {"started": started, "built": built, "finished": finished, "total_pages": note["total_pages"],
            "pages": _pages(pdf), "pdf_mb": round(len(pdf) / 2**20, 1), "pid": os.getpid(),
            "asked": range_times.ASKED}


def _peak_kb(pid: int) -> int:
    """The process's peak RSS so far (VmHWM), 0 if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)


def _at(samples: list[tuple[float, float]], when: float) -> float:
    """The busy seconds at `when`, between the two samples (time, busy) around it."""
    after = next((i for i, (t, _) in enumerate(samples) if t >= when), None)
    if after is None:
        raise RuntimeError(f"no busy-time sample at or after {when}: the sampler stopped early")
    (t0, b0), (t1, b1) = samples[max(0, after - 1)], samples[after]
    return b0 + (b1 - b0) * ((when - t0) / (t1 - t0) if t1 > t0 else 0)


def _makespan(durations: list[float], slots: int) -> float:
    """When the last task ends with `slots` of them at a time, each task to the first free slot."""
    free = [0.0] * slots
    for d in durations:
        free.sort()
        free[0] += d
    return max(free)


def _pages(pdf: bytes) -> int:
    import io

    import pikepdf

    with pikepdf.open(io.BytesIO(pdf)) as p:
        return len(p.pages)


if __name__ == "__main__":
    main()
