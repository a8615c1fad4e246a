"""A tail shard's file read once for its parts (driver._SharedRows): one read, its bytes handed
to each part, let go after the last; the first notes' shard and whole shards read their own."""

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
    rows = _SharedRows(units)

    given = [(shard, rows.ref(Chain(shard, part), settings, "run", lambda shard: None)) for shard, part in units]

    for tail in (3, 4):
        refs = [ref for shard, ref in given if shard == tail]
        assert len(refs) == TAIL_PARTS and all(ref is refs[0] for ref in refs), "one read a tail shard"
        assert ray.get(refs[0]) == store.get(keys.shard_key("run", tail))
    assert all(ref is None for shard, ref in given if shard in (1, 2)), "the first notes' and whole shards read their own"
    assert rows.refs == {} and rows.parts == {}, "let go once the last part is asked for"
