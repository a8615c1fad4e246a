"""A money amount as a note prints it: half up to the paisa (or the places asked), Indian digit
grouping (12,34,567.89), amounts payable by the client in brackets (-0.001 too: "(0.00)").

A note prints ~140 amounts. `money` and `column` (a levies column's) are amounts.c's, built by
pipeline/native.py as an extension module (~0.09 µs an amount); `printed` and `printed_column` are
their Python twins (~0.4 µs), which the C hands whatever it does not print itself, and which run
alone where the C cannot be built. tests/test_money.py holds both to the plain rule.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

from pipeline import native


def printed(amount: Decimal, places: int = 2) -> str:
    """The rounded amount's str() (its exponent is -places, so never scientific), commas by
    slicing below a crore: Python's format and a Decimal comparison or two cost more than all of it."""
    if not amount:
        return _ZEROS[places]  # -0 too: no brackets
    negative = amount < _ZERO
    text = str((-amount if negative else amount).quantize(_STEPS[places], ROUND_HALF_UP))
    whole = len(text) - places - 1 if places else len(text)  # digits before the point
    if whole > 3:
        if whole < 6:
            text = f"{text[:whole - 3]},{text[whole - 3:]}"
        elif whole < 8:
            text = f"{text[:whole - 5]},{text[whole - 5:whole - 3]},{text[whole - 3:]}"
        else:  # a crore or more: the lakhs and crores in pairs
            head, odd = text[:whole - 3], (whole - 3) % 2
            groups = ([head[:odd]] if odd else []) + [head[i:i + 2] for i in range(odd, len(head), 2)]
            text = f"{','.join(groups)},{text[whole - 3:]}"
    return f"({text})" if negative else text


def printed_column(values: tuple[Decimal, ...], charges: tuple[bool, ...]) -> list[str]:
    """A column of the levies table: each value printed, a charge negated (the client pays it)."""
    return [printed(-v) if charge else printed(v) for v, charge in zip(values, charges)]


_STEPS = tuple(Decimal(1).scaleb(-places) for places in range(5))
_ZEROS = tuple(f"{step - step:f}" for step in _STEPS)  # 0, 0.0, 0.00 ...
_ZERO = Decimal(0)  # a Decimal beside a Decimal: an int 0 is made a Decimal at each comparison


def _compiled():
    module = native.extension(Path(__file__).with_name("amounts.c"), "amounts are printed in Python (~0.25 µs more each)")
    if module is None:
        return printed, printed_column
    module.set_fallback(printed)
    return module.money, module.column


money, column = _compiled()
