"""Trades that moved between clients. A modification (status 12) or a cancellation (13) names the
trade's client as it now stands, and a trade number is the exchange's and segment's, not the
client's: a client code modification gives the trade to another client, whose rows may be in any
range and shard of the day. Each range's read packs its modified and cancelled rows as pairs of
integers (the trade, its client); their owners (each trade's last such row's client) are worked
out once a day into two sorted arrays, 16 bytes a trade, which every assembly reads from Ray's
object store (a copy of its own only for a day of a few thousand moves, which Ray inlines).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from pipeline.day.dumps import NUMBER16, SEGMENTS, SEP, UCC

NOBODY = -1  # a move whose client code is not valid: whose trade it is now is not known
_SEGMENT = {segment: i for i, segment in enumerate(SEGMENTS)}  # "NSE-FO" -> 0..7
_ROW_SEGMENT = {segment.replace("-", SEP): i for segment, i in _SEGMENT.items()}  # as a shard row's identity has it
_DIGITS = {c: i + 1 for i, c in enumerate("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")}


def move(values: tuple[str, ...], at: int) -> tuple[int, int] | None:
    """A modified or cancelled trade row's (trade_key, client_key), its fields stripped as the
    parsers strip them, valid or not (a bad row rejects its own account, and the trade is still
    not the first client's); None when no valid row has its trade."""
    key = trade_key(values[1].strip(), values[2].strip(), values[7].strip())
    return None if key is None else (key, client_key(values[at].strip()))


def trade_key(exchange: str, segment: str, number: str) -> int | None:
    """A trade (its exchange, segment and 16-digit number) as one integer; None for any other."""
    code = _SEGMENT.get(f"{exchange}-{segment}")
    return None if code is None or not NUMBER16.match(number) else int(number) * 16 + code


def row_key(identity: str) -> int:
    """trade_key of a validated trade's `exchange SEP segment SEP number` (a shard row's identity)."""
    return int(identity[-16:]) * 16 + _ROW_SEGMENT[identity[:-17]]


def client_key(ucc: str) -> int:
    """A client code (1-10 letters or digits, case kept) as one integer, never 0; NOBODY for any
    other text."""
    if not UCC.match(ucc):
        return NOBODY
    key = 0
    for c in ucc:
        key = key * 63 + _DIGITS[c]
    return key


def packed(pairs: list[tuple[int, int]]) -> np.ndarray:
    """A range's moves, in file order, as read_range hands them on."""
    return np.array(pairs, dtype=np.int64).reshape(-1, 2)


@dataclass(frozen=True, eq=False)
class Owners:
    trades: np.ndarray  # int64, sorted
    clients: np.ndarray  # int64: client_key of each trade's last modifying or cancelling row's client

    def __len__(self) -> int:
        return len(self.trades)

    def of(self, keys: list[int]) -> np.ndarray:
        """Each key's owner (client_key, or NOBODY), 0 where the trade never moved."""
        wanted = np.asarray(keys, dtype=np.int64)
        if not len(self.trades):
            return np.zeros(len(wanted), dtype=np.int64)
        at = np.minimum(np.searchsorted(self.trades, wanted), len(self.trades) - 1)
        return np.where(self.trades[at] == wanted, self.clients[at], 0)


def owners(changes: Iterable[np.ndarray]) -> Owners:
    """The owners of every range's moves (`packed`), given in the plan's order: of a trade's
    moves, the last one given is the file's last row of it."""
    both = np.concatenate([np.empty((0, 2), dtype=np.int64), *changes])[::-1]  # the last first
    trades, last = np.unique(both[:, 0], return_index=True)
    return Owners(trades, both[last, 1])
