"""bench/render.py's timer of a huge note's page ranges, set up in each of its Ray workers
(runtime_env's worker_process_setup_hook): wherever a range is rendered, by its task or by the
render task that asked for it, its start and end (epoch seconds) and the process's PID go to a
file named by its first page, in the directory CN_BENCH_RANGE_TIMES names. Only the render call
is timed: a range task's argument, its memo's release and its result's trip through Ray's
object store are not. When the render task asked for each range's task (handed it to Ray) is
kept in its process, in ASKED, for bench/render.py's task to return: Ray's task events told it
before, and reading them took Ray's dashboard, whose CPU counted in the note's."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

DIR = "CN_BENCH_RANGE_TIMES"
ASKED: list[float] = []  # in the render task's process: when each range's task was asked for (epoch seconds)


def hook() -> None:
    from pipeline.cluster import page_ranges

    compiled, task = page_ranges.compiled, page_ranges.render_pages_task

    def timed(part: dict, tagged: bool) -> bytes:
        began = time.time()
        pdf = compiled(part, tagged)
        ended = time.time()
        with open(Path(os.environ[DIR], str(part["page_offset"])), "x") as out:  # a range rendered twice: an error
            out.write(json.dumps([os.getpid(), began, ended]))
        return pdf

    class Asked:
        """render_pages_task.options(...), each .remote() noted once it has returned."""

        def __init__(self, options: dict) -> None:
            self.asking = task.options(**options)

        def remote(self, *args):
            ref = self.asking.remote(*args)
            ASKED.append(time.time())
            return ref

    page_ranges.compiled = timed
    page_ranges.render_pages_task = SimpleNamespace(options=lambda **options: Asked(options))


def read(directory: str) -> dict[int, tuple[int, float, float]]:
    """First page -> (PID, start, end) of each range rendered."""
    return {int(p.name): tuple(json.loads(p.read_text())) for p in Path(directory).iterdir()}
