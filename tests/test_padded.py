"""A note's trade table padded by padded.c is what its Python twin, content.padded, makes: the
same widths and lines for any cells, the twin's own where a cell is not ASCII (issue 73)."""

from __future__ import annotations

import random
import string
from pathlib import Path

from pipeline import native
from pipeline.note import content

COLUMNS = len(content.TRADE_COLUMNS)


def test_the_compiled_padding_is_the_one_in_use():
    assert content._padded is not content.padded, "pipeline/native.py builds it: gcc and Python's headers"


def test_the_compiled_padding_makes_the_twin_s_widths_and_lines():
    rng = random.Random(73)
    alphabet = string.ascii_letters + string.digits + ",.()/ -" + " \t\x0b\x0c\x1c\x1f"
    for _ in range(400):
        rows = [(rng.choice(["NSE / CM  ·  Settlement 1", "MCX / COM"]),
                 tuple("".join(rng.choices(alphabet, k=rng.choice((0, 1, 5, 12, 40)))) for _ in range(COLUMNS)))
                for _ in range(rng.randint(0, 30))]
        assert content._padded(rows) == content.padded(rows)


def test_a_cell_not_ascii_is_padded_by_the_twin():
    cells = ("1", "09:15:00", "2", "09:15:01", "ÉCLAIR EQ", "B", "10", "1.0000", "0.0000", "1.0000", "", "(10.00)",
             "CNC")
    rows = [("NSE / CM", cells), ("NSE / CM", tuple(c.replace("É", "E") for c in cells))]
    lines = native.extension(Path(content.__file__).with_name("padded.c"), "").lines
    assert lines(rows, content._LEAST_WIDTHS, (False,) * COLUMNS, content.GAP) is None
    assert content._padded(rows) == content.padded(rows) and content.padded(rows)[1][0][1].startswith("1   ")


def test_the_compiled_wide_spaces_are_the_twin_s_and_as_wide_as_the_runs_they_replace():
    from pipeline.note import spaced

    assert spaced._spaced is not spaced.spaced, "pipeline/native.py builds it: gcc and Python's headers"
    rng = random.Random(72)
    for _ in range(5000):
        line = "".join(rng.choice(["a", "1,0", " ", "  ", " " * rng.randint(3, 90), "É", "\u2003"])
                       for _ in range(rng.randint(0, 14)))
        out = spaced._spaced(line)
        assert out == spaced.spaced(line)
        assert sum(spaced.WIDE_SPACES.get(ord(c), 1) for c in out) == len(line)  # each cell where it was
        assert [t for t in out.split() if t] == line.split()  # str.split() takes them as spaces, as pdftotext does


def test_a_wide_space_in_a_cell_stays_one_cell():
    from pipeline.note import spaced

    assert spaced._spaced("A\u2003B  C") == "A B\u2002C"
