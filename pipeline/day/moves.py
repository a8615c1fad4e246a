"""Trades that moved between clients. A modification (status 12) or a cancellation (13) names the
trade's client as it now stands, and a trade number is the exchange's and segment's, not the
client's: a client code modification gives the trade to another client, whose rows may be in any
range and shard of the day. Each range's read lists its modified and cancelled rows; their owners
(each trade's last such row's client) are worked out once a day into two sorted arrays, 16 bytes a
trade, which every assembly reads from Ray's object store without a copy of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from pipeline.day.dumps import SEGMENTS, SEP, UCC

NOBODY = -1  # a move whose client code is not valid: whose trade it is now is not known
_THEN = "\x1e"  # between a move's trade and its client: no valid field holds it (a control character)
_SEGMENT = {segment.replace("-", SEP): i for i, segment in enumerate(SEGMENTS)}
_DIGITS = {c: i + 1 for i, c in enumerate("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")}


def move(values: tuple[str, ...], at: int) -> str:
    """A trade row's move, `exchange SEP segment SEP number _THEN ucc`, its fields stripped as the
    parsers strip them (valid or not: a bad row rejects its own account, and the trade is still
    not the first client's); "" when a field holds what no valid row does."""
    line = f"{values[1].strip()}{SEP}{values[2].strip()}{SEP}{values[7].strip()}{_THEN}{values[at].strip()}"
    return "" if "\n" in line or line.count(_THEN) != 1 else line


def trade_key(identity: str) -> int | None:
    """A valid trade's `exchange SEP segment SEP number` as one integer; None for any other."""
    number, segment = identity[-16:], _SEGMENT.get(identity[:-17])
    if segment is None or identity[-17:-16] != SEP or not number.isdigit() or not number.isascii():
        return None
    return int(number) * 16 + segment


def client_key(ucc: str) -> int:
    """A client code (1-10 letters or digits) as one integer, never 0; NOBODY for any other text."""
    if not UCC.match(ucc):
        return NOBODY
    key = 0
    for c in ucc:
        key = key * 63 + _DIGITS[c]
    return key


@dataclass(frozen=True)
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


def owners(moves: Iterable[str]) -> Owners:
    """The owners of read_range's moves (`move` lines, every range's in the plan's order: the
    last line read of a trade is the file's last row of it)."""
    last: dict[int, int] = {}
    for text in moves:
        for line in text.split("\n") if text else ():
            identity, ucc = line.split(_THEN)
            key = trade_key(identity)
            if key is not None:  # an identity no valid row has moves nothing
                last[key] = client_key(ucc)
    trades = np.fromiter(last, dtype=np.int64, count=len(last))
    order = np.argsort(trades, kind="stable")
    return Owners(trades[order], np.fromiter(last.values(), dtype=np.int64, count=len(last))[order])
