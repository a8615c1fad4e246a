"""A huge note (a volatile day's 2,000 pages) cut into page ranges, rendered in parallel on its
render task's node and merged with continuous page numbers.

Each range is claimed once, by its range task or by the render task that asked for it: a claim
is a symlink made in the render task's private directory, which no two processes can both make.
The render task, its other notes compiled, renders the ranges no task has started, from the
last, and waits only for those running. Waiting on all of them instead, it lent its CPU to
Ray, which started one more worker, cold, for a range (in bench/render.py about a second of a
core to start it and 0.5 s more for its first range). The cost: a range that crashes its
process (Typst's own fault, the kernel's OOM killer) in the render task takes the render task
down, and Ray renders the whole shard again, where a range task alone would have been run again.
Here this module is all a range worker imports: not the driver's dependencies.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline.note.assemble import merge
from pipeline.note.content import page_range
from pipeline.note.render import compiled, compiler, forget, render_all

log = logging.getLogger("pipeline.cluster.page_ranges")
PARALLEL_FROM_PAGES = 100
RANGE_PAGES = 50  # bench/render.py's 1,961 pages took 12.1 CPU-s in 25-page ranges, 11.3 in 50, 12.1 in 100; a
# range forgets Typst's memo after it (render.forget): in one process a worker peaked at 157 MB with 50, 116 with 25
TASK, OWN = "task", "render task"  # who holds a claim: the range's task, or the render task that asked


@ray.remote(num_cpus=1, max_retries=3)  # on the node of the render task that asks (render_notes)
def render_pages_task(part: dict, tagged: bool, claim: str) -> bytes | None:
    """One page range of a huge note, unless its render task claimed it first (None: not
    rendered here). What Typst memoised for it is dropped after: the next range shares none of
    it (render.forget). A range holds a CPU of its render task's node, not a render slot: the
    render task waiting on the ranges keeps its slot (Ray lends a blocked task's CPUs, not its
    custom resources), so a range that needed a slot could not have the CPU it lends, and with
    every slot held by such tasks no range could run."""
    if not claimed(claim, TASK):
        return None
    pdf = compiled(part, tagged)
    _forget()
    return pdf


def claimed(path: str, who: str) -> bool:
    """Whether `who` holds the claim at `path`, making it if nobody does. A task Ray runs again
    (its worker lost mid-range) finds its own claim and renders the range; a claim's directory
    gone means the render task that asked is gone, and the range is nobody's to render."""
    try:
        os.symlink(who, path)
        return True
    except FileNotFoundError:
        return False
    except FileExistsError:
        pass
    try:
        return os.readlink(path) == who
    except FileNotFoundError:  # removed between the two calls: its render task is done
        return False


def render_notes(notes: list[dict], tagged: bool = False) -> list[bytes | Exception]:
    """A shard's notes: those of a few pages compiled together here; each huge one cut into page
    ranges, asked for first so that they render while this task compiles the rest, then those
    not started rendered here. They run on this task's node: losing the node loses this task
    too, which Ray runs again elsewhere. Each note's PDF, or its error."""
    pages = {i: note["total_pages"] for i, note in enumerate(notes) if note["total_pages"] > PARALLEL_FROM_PAGES}
    if not pages:
        return render_all(notes, tagged)
    claims = Path(tempfile.mkdtemp(prefix="claims-", dir=compiler().dir))
    try:
        here = render_pages_task.options(name="render pages", scheduling_strategy=NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False))
        parts = {i: [page_range(notes[i], a, min(a + RANGE_PAGES, n)) for a in range(0, n, RANGE_PAGES)]
                 for i, n in pages.items()}
        refs = {i: [here.remote(part, tagged, str(claims / f"{i}-{k}")) for k, part in enumerate(ranges)]
                for i, ranges in parts.items()}
        small = iter(render_all([note for i, note in enumerate(notes) if i not in pages], tagged))
        own = _render_unstarted(parts, refs, claims, tagged)
        return [_merged(refs[i], own.get(i, {}), notes[i]) if i in pages else next(small) for i in range(len(notes))]
    finally:
        shutil.rmtree(claims, ignore_errors=True)


def _render_unstarted(parts: dict[int, list[dict]], refs: dict[int, list], claims: Path,
                      tagged: bool) -> dict[int, dict[int, bytes | Exception]]:
    """The ranges this task claims, the last first (Ray starts the tasks in the order asked),
    each rendered here; the task of each is cancelled, so that none holds a worker to find its
    range taken. A range that fails here fails its note, as one whose task's retries are spent."""
    own: dict[int, dict[int, bytes | Exception]] = {}
    for i in reversed(parts):
        for k in reversed(range(len(parts[i]))):
            if not claimed(str(claims / f"{i}-{k}"), OWN):
                continue
            ray.cancel(refs[i][k])
            try:
                pdf = compiled(parts[i][k], tagged)
            except Exception as e:
                pdf = e
            own.setdefault(i, {})[k] = pdf
            _forget()
    return own


def _merged(refs: list, own: dict[int, bytes | Exception], note: dict) -> bytes | Exception:
    try:
        return merge((_part(own[k]) if k in own else ray.get(ref) for k, ref in enumerate(refs)), note)
    except Exception as e:  # a range that failed (its own retries spent) fails its note only
        return e


def _part(pdf: bytes | Exception) -> bytes:
    if isinstance(pdf, Exception):
        raise pdf
    return pdf


def _forget() -> None:
    try:
        forget()
    except Exception as e:  # the range is rendered: a memo not cleared costs memory, not the note
        log.warning("Typst's memo not cleared after a page range: %s", e)
