"""A huge note's page ranges: each claimed once, by its range task or by the render task that
asked for it, and merged in order whichever rendered it."""

from __future__ import annotations

import io
import subprocess

import pikepdf
import pytest

from pipeline.cluster.page_ranges import OWN, PARALLEL_FROM_PAGES, RANGE_PAGES, TASK, claimed, render_pages_task
from pipeline.note.content import ROWS_PER_PAGE, page_range
from tests.test_render import sample_note


def test_a_claim_is_held_by_whoever_made_it_first_and_again_by_it_alone(tmp_path):
    claim = str(tmp_path / "0-3")
    assert claimed(claim, TASK)
    assert claimed(claim, TASK)  # the task run again by Ray, its worker lost mid-range: still its range
    assert not claimed(claim, OWN)


def test_a_claim_whose_render_task_is_gone_is_nobody_s(tmp_path):
    assert not claimed(str(tmp_path / "gone" / "0-3"), TASK)


@pytest.fixture(scope="module")
def part():
    return page_range(sample_note(3 * ROWS_PER_PAGE), 1, 3)


def test_a_range_its_render_task_claimed_is_not_rendered_by_its_task(tmp_path, part):
    claim = str(tmp_path / "0-1")
    assert claimed(claim, OWN)
    assert render_pages_task._function(part, False, claim) is None


def test_a_range_task_run_again_renders_its_range_again(tmp_path, part):
    claim = str(tmp_path / "0-1")
    for _ in range(2):
        with pikepdf.open(io.BytesIO(render_pages_task._function(part, False, claim))) as rendered:
            assert len(rendered.pages) == 2
    assert not claimed(claim, OWN)


def test_a_huge_note_s_ranges_merge_in_page_order_whoever_rendered_each(ray_session, tmp_path):
    """A free CPU beside the render task, so that its tasks may take the first ranges while it
    takes the last (bench/render.py counts who took which): each page of the merged PDF is
    still the page its footer numbers, and the shard's other note is its own."""
    import ray

    from pipeline.cluster.driver import RENDER_SLOT
    from pipeline.cluster.page_ranges import render_notes

    note = sample_note((PARALLEL_FROM_PAGES + 2 * RANGE_PAGES) * ROWS_PER_PAGE)
    small = sample_note(12)
    huge, lone = ray.get(ray.remote(**RENDER_SLOT)(lambda ns: render_notes(ns)).remote([note, small]), timeout=120)
    path = tmp_path / "merged.pdf"
    path.write_bytes(huge)
    pages = subprocess.run(["pdftotext", "-layout", str(path), "-"], capture_output=True, text=True,
                           check=True).stdout.split("\f")[:-1]
    total = note["total_pages"]
    assert len(pages) == total > PARALLEL_FROM_PAGES + RANGE_PAGES
    assert [f"Page {k} of {total}" in page for k, page in enumerate(pages, 1)] == [True] * total
    assert "Levies and charges" in pages[-1] and "Levies and charges" not in pages[-2]
    with pikepdf.open(io.BytesIO(lone)) as alone:
        assert len(alone.pages) == small["total_pages"]


def test_a_huge_note_is_rendered_with_every_slot_and_cpu_held(ray_session, tmp_path):
    """Both render slots held, one by a shard's render task still at work, one by the render task
    of a huge note: no range task can start until the render task waits, and it renders every
    range no task has started itself. Once, a range asked for a render slot (or a sliver of one),
    which the waiting task keeps (Ray lends a blocked task's CPUs, not its custom resources): no
    range could start, and the note waited for the other shard's end, or for ever with two such
    notes on two slots."""
    note = sample_note((PARALLEL_FROM_PAGES + RANGE_PAGES) * ROWS_PER_PAGE)
    [pdf] = beside_a_busy_shard([note], tmp_path)
    with pikepdf.open(io.BytesIO(pdf)) as merged:
        assert len(merged.pages) == note["total_pages"] > PARALLEL_FROM_PAGES


def test_a_range_that_fails_in_the_render_task_fails_its_note_alone(ray_session, tmp_path):
    """The other slot held, the render task renders every range itself; the last one's data is
    such that Typst fails it. Before, the failure's own bookkeeping raised a KeyError out of
    render_notes, and every note of the shard failed with it."""
    note = sample_note((PARALLEL_FROM_PAGES + RANGE_PAGES) * ROWS_PER_PAGE)
    note["pages"][-1]["groups"][0]["lines"] = "not a list of lines"  # Typst cannot join it
    small = sample_note(12)
    huge, lone = beside_a_busy_shard([note, small], tmp_path)
    assert isinstance(huge, Exception) and "join" in str(huge), huge
    with pikepdf.open(io.BytesIO(lone)) as alone:
        assert len(alone.pages) == small["total_pages"]


def beside_a_busy_shard(notes: list[dict], tmp_path) -> list:
    """render_notes in a render task while another render task holds the other slot and CPU,
    at work until these notes are out."""
    import time

    import ray

    from pipeline.cluster.driver import RENDER_SLOT
    from pipeline.cluster.page_ranges import render_notes

    released = tmp_path / "released"

    def other_shard() -> None:
        deadline = time.monotonic() + 180
        while not released.exists() and time.monotonic() < deadline:
            time.sleep(0.1)

    busy = ray.remote(**RENDER_SLOT)(other_shard).remote()
    try:
        return ray.get(ray.remote(**RENDER_SLOT)(lambda ns: render_notes(ns)).remote(notes), timeout=120)
    finally:
        released.touch()
        ray.get(busy, timeout=60)
