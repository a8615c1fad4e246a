"""A shard file's bytes handed to its chains (driver._SharedRows): a tail shard's file read once
for its parts, the split's own bytes for the shards it handed, each let go after the shard's last
chain; the others read their own."""

from __future__ import annotations

import pytest
import ray

from pipeline.cluster.driver import TAIL_PARTS, Chain, _SharedRows, _units
from pipeline.record import keys
from pipeline.record.storage import open_store
from pipeline.settings import Settings


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("shard_size", [8, 16])  # 16: a tail's first part is (0, 4), as the first notes' is
def test_a_tail_shard_is_read_once_for_its_parts_and_no_other_shard_shares_a_read(tmp_path, shard_size):
    settings = Settings(store_url=str(tmp_path / "store"))
    store = open_store(settings.store_url)
    for shard in (1, 2, 3, 4):
        store.put(keys.shard_key("run", shard), f'{{"ucc": "C{shard}"}}\n'.encode())
    units = _units([1, 2, 3, 4], first=1, cut=2, shard_size=shard_size)  # 1: the first notes' two; 2 whole; 3, 4 the tail
    rows = _SharedRows(units, {})

    given = [(shard, rows.ref(Chain(shard, part), settings, "run", lambda shard: None)) for shard, part in units]

    for tail in (3, 4):
        refs = [ref for shard, ref in given if shard == tail]
        assert len(refs) == TAIL_PARTS and all(ref is refs[0] for ref in refs), "one read a tail shard"
        assert ray.get(refs[0]) == store.get(keys.shard_key("run", tail))
    assert all(ref is None for shard, ref in given if shard in (1, 2)), "the first notes' and whole shards read their own"
    assert rows.refs == {} and rows.left == {}, "let go once the last part is asked for"


@pytest.mark.usefixtures("ray_session")
def test_the_bytes_the_split_handed_go_to_each_chain_of_their_shard_and_are_let_go_after_the_last(tmp_path):
    settings = Settings(store_url=str(tmp_path / "store"))
    units = _units([1, 2, 3, 4], first=1, cut=2, shard_size=8)
    handed = {shard: ray.put(f"shard {shard}".encode()) for shard in (1, 2, 3)}  # 4: not handed, a tail shard
    open_store(settings.store_url).put(keys.shard_key("run", 4), b'{"ucc": "C4"}\n')
    rows = _SharedRows(units, handed)

    given = [(shard, rows.ref(Chain(shard, part), settings, "run", lambda shard: None)) for shard, part in units]

    for shard in (1, 2, 3):
        assert {ray.get(ref) for s, ref in given if s == shard} == {f"shard {shard}".encode()}
    assert len({ref for s, ref in given if s == 4}) == 1, "a tail shard not handed: read once"
    assert handed == {} and rows.left == {}, "let go once the shard's last chain is asked for"
