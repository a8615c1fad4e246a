"""The note's money, amounts.c's and its Python twin's, prints every amount exactly as the plain
rule does: half up to the paisa (or the places asked), Indian grouping, brackets for what the
client pays (issue 73). What the C hands to the twin (a NaN, a huge exponent) is the twin's."""

from __future__ import annotations

import random
from decimal import ROUND_HALF_UP, Decimal

from pathlib import Path

import pytest

from pipeline.note import amounts, content

BOTH = [amounts.money, amounts.printed]


def plain(amount: Decimal, places: int = 2) -> str:
    """The rule as it was written before the fast paths: round, then group by hand."""
    exact = abs(amount).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)
    whole, dot, frac = f"{exact:f}".partition(".")
    if len(whole) > 3:
        head, odd = whole[:-3], (len(whole) - 3) % 2
        groups = ([head[:odd]] if odd else []) + [head[i:i + 2] for i in range(odd, len(head), 2)]
        whole = ",".join(groups) + "," + whole[-3:]
    text = whole + dot + frac
    return f"({text})" if amount < 0 else text


EDGES = ["0", "-0", "0.00", "-0.00", "0.001", "-0.001", "0.005", "-0.005", "0.0049999", "-0.0049999", "0.01", "-0.01",
         "999.995", "-999.995", "999.994", "99999.99", "99999.994", "99999.995", "-99999.995", "100000", "-100000",
         "9999999.995", "-9999999.995", "10000000", "99999999.99", "100000000", "123456789.125", "-123456789.125",
         "1E+5", "1E+7", "-1E+9", "12345678901234.565", "-999999999999999.99", "1E-28", "-1E-28", "0.00005",
         "0.00004999", "2983.9", "5.72888805E+5", "12.5", "-12.5", "1E+2", "-1.5E+3", "5E-5", "-5E-5", "1E-7", "0.5",
         "-0.5", "100", "-100", "12345.6789", "12345.67891", "-0.0001", "0.00010", "572888.80", "1.000", "1.00000"]


def test_the_compiled_money_is_the_one_in_use():
    assert content.money is amounts.money is not amounts.printed, "pipeline/native.py builds it: gcc and Python's headers"


@pytest.mark.parametrize("money", BOTH)
def test_money_matches_the_plain_rule_at_the_edges(money):
    for text in EDGES:
        for places in range(5):
            value = Decimal(text)
            assert money(value, places) == plain(value, places), (text, places)


@pytest.mark.parametrize("money", BOTH)
def test_money_matches_the_plain_rule_on_a_random_sweep(money):
    rng = random.Random(73)
    for _ in range(40_000):
        digits = rng.randint(1, 18)
        value = Decimal(rng.randrange(10 ** digits)).scaleb(-rng.randint(-3, 6))  # 1E+3 .. 1E-6 a unit
        if rng.random() < 0.5:
            value = -value
        places = rng.choice((2, 2, 4, 0, 1, 3))
        assert money(value, places) == plain(value, places), (value, places)


@pytest.mark.parametrize("money", BOTH)
def test_money_as_the_note_prints_it(money):
    assert money(Decimal("-0")) == "0.00" and money(Decimal("-0.001")) == "(0.00)"
    assert money(Decimal("99999.995")) == "1,00,000.00" and money(Decimal("-123456789.125")) == "(12,34,56,789.13)"
    assert money(Decimal("1E+7"), 0) == "1,00,00,000" and money(Decimal("2983.9"), 4) == "2,983.9000"


def test_the_compiled_money_hands_the_twin_what_it_does_not_print():
    """Past the default context's 28 digits, at a far exponent, for another type or places: the
    same text or the same error as the twin's, whichever part printed it."""
    for amount, places in [("1234567890123456789012345.675", 2), ("12345678901234567890123456.785", 2),
                           ("-12345678901234567890123456.785", 2), ("99999999999999999999999999.995", 2),
                           ("1E+25", 2), ("1E+26", 2), ("1E+40", 0), ("1E-80", 2), ("-1E-80", 4), ("-99.995", 2),
                           ("9.5", 0), ("NaN", 2), ("-Infinity", 2), ("1", 7), ("1", -1), (1.5, 2), ("1", True)]:
        value = Decimal(amount) if isinstance(amount, str) else amount
        assert _outcome(amounts.money, value, places) == _outcome(amounts.printed, value, places), (amount, places)


def _outcome(money, *args) -> str:
    try:
        return money(*args)
    except (ArithmeticError, AttributeError, TypeError, IndexError) as e:
        return type(e).__name__


def test_a_levies_column_is_each_value_printed_a_charge_negated():
    rng = random.Random(7)
    for _ in range(2_000):
        values = tuple(Decimal(rng.randrange(-10 ** 12, 10 ** 12)).scaleb(-rng.randint(0, 4)) for _ in range(13))
        charges = tuple(rng.random() < 0.7 for _ in values)
        assert amounts.column(values, charges) == amounts.printed_column(values, charges) == [
            plain(-v if c else v) for v, c in zip(values, charges)]
    odd = (Decimal("-0"), Decimal("0.001"), Decimal("-12345678901234567890123456.785"), Decimal("1E-80"))
    assert amounts.column(odd, (True,) * 4) == amounts.printed_column(odd, (True,) * 4) == [
        "0.00", "(0.00)", "1,23,45,67,89,01,23,45,67,89,01,23,456.78", "(0.00)"]


def test_a_cached_build_that_cannot_be_imported_leaves_the_twin_in_use(tmp_path, monkeypatch, caplog):
    """A cached file that is not a module this Python can load (one built elsewhere, edited): the
    twin runs, with a warning, and the module that asked is still imported."""
    from pipeline import native

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = Path(amounts.__file__).with_suffix(".c")
    target = native.built(source)
    target.write_bytes(b"not a shared object")
    assert native.extension(source, "the Python twin prints amounts") is None
    assert "cannot be imported" in caplog.text

