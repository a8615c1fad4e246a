"""A broker whose commodity membership is a company of its own: each entity's run makes notes
for its own segments alone, with its own details and note numbers (CN_BROKER_FILE), and leaves
the other entity's trades to its run, counted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import stages
from pipeline.day.dumps import Client
from pipeline.day.split import find_account, make_plan, read_range, split_day
from pipeline.record.manifest import save_manifest
from pipeline.record.state import RunState
from pipeline.record.storage import open_store
from pipeline.settings import TEMPLATES, ConfigError
from tests.every_segment_day import DATE, UCC, note_text, write_every_segment_day
from tests.recompute import check_text, recompute

COMMODITY = ["MCX-COM", "NCDEX-COM"]
OTHERS = ["BSE-CDS", "BSE-CM", "BSE-FO", "NSE-CDS", "NSE-CM", "NSE-FO"]


def entity_file(folder: Path, name: str, segments: list[str], left_to: dict[str, str], prefix: str) -> str:
    data = json.loads((TEMPLATES / "broker.json").read_text())
    data.update(name=name, segments=segments, left_to=left_to, note_prefix=prefix)
    path = folder / f"{prefix}.json"
    path.write_text(json.dumps(data))
    return str(path)


def split_for(folder: Path, store_dir: Path, redis_url: str, run: str, broker_file: str):
    store, entity = open_store(str(store_dir)), stages.broker(broker_file)
    split = split_day(open_store(str(folder)), store, RunState(redis_url, run), run, DATE, 10, entity["note_prefix"],
                      entity)
    save_manifest(store, run, split)
    return store, split


def test_each_entity_s_run_makes_notes_for_its_own_segments_and_leaves_the_other_s_counted(tmp_path, redis_url):
    folder = write_every_segment_day(tmp_path / "in", 20, seed=5)
    securities = entity_file(tmp_path, "Example Securities Private Limited", OTHERS,
                             dict.fromkeys(COMMODITY, "Example Commodities Private Limited"), "CNT")
    commodities = entity_file(tmp_path, "Example Commodities Private Limited", COMMODITY,
                              dict.fromkeys(OTHERS, "Example Securities Private Limited"), "CNC")
    everything = recompute(folder, DATE)
    commodity_rows = sum(int(f["trades"]) for a in everything.values() for s, f in a.items() if s in COMMODITY)

    for run, broker_file, mine in (("sec", securities, OTHERS), ("com", commodities, COMMODITY)):
        store, split = split_for(folder, tmp_path / run, redis_url, run, broker_file)
        expected = {u: {s: f for s, f in a.items() if s in mine} for u, a in everything.items()}
        expected = {u: a for u, a in expected.items() if a}
        assert split.rejected == 0 and split.accounts == len(expected)
        left = split.left_to_others
        if run == "sec":
            assert set(left) == set(COMMODITY)
            assert left["MCX-COM"]["entity"] == "Example Commodities Private Limited"
            # the commodity rows as the file has them, cancellations and modifications too
            assert sum(v["trades"] for v in left.values()) >= commodity_rows
        else:
            assert set(left) <= set(OTHERS) and sum(v["trades"] for v in left.values()) > 0
        for ucc, figures in expected.items():
            account = find_account(store, run, ucc)
            note = stages.note_data(account, Client(**account["client"]), DATE, {"NSE": "2026-11-23",
                                                                                 "BSE": "2026-11-23"}, broker_file)
            assert check_text(note_text(note), figures) == [], (run, ucc)
            assert note["broker"]["name"] == stages.broker(broker_file)["name"]
            assert account["note_no"].startswith(stages.broker(broker_file)["note_prefix"] + "-26/27-")
        every = find_account(store, run, UCC)
        assert sorted({f"{t[1]}-{t[2]}" for t in every["trades"]}) == mine


def test_a_trade_on_a_segment_no_entity_holds_rejects_its_account_by_row(tmp_path, redis_url):
    folder = write_every_segment_day(tmp_path / "in", 3, seed=5)
    equity = entity_file(tmp_path, "Equity Only", ["NSE-CM", "NSE-FO", "BSE-CM", "BSE-FO"], {}, "EQN")
    inputs = open_store(str(folder))
    plan = make_plan(inputs, DATE, 10, 1, entity=stages.broker(equity))
    rng = next(r for r in plan.ranges if r.file == "trades.csv")
    meta, (bucket,) = read_range(inputs, rng, plan.columns["trades.csv"], plan.shard_count, 1, DATE, plan.closes,
                                 segments=plan.segments, left_to=plan.left_to)
    errors = [json.loads(line.split("\x1e", 1)[1]) for text in bucket.values() for line in text.split("\n")
              if line.startswith("e" + UCC)]
    assert errors and {e["field"] for e in errors} == {"segment"}
    assert errors[0]["error"].endswith("is not a membership of the issuing entity (its broker file's segments), nor "
                                       "left to another's (left_to)")
    state = RunState(redis_url, "eq")
    split = split_day(inputs, open_store(str(tmp_path / "s")), state, "eq", DATE, 10, "EQN")  # no entity: all taken
    assert split.rejected == 0


@pytest.mark.parametrize("change, said", [
    ({"segments": ["NSE-CM", "MCX-CM"]}, "'MCX-CM' is not an exchange-segment"),
    ({"segments": ["NSE-CM"], "left_to": {"NSE-CM": "Other"}}, "NSE-CM both in its segments and left to another"),
])
def test_a_broker_file_naming_a_segment_wrongly_is_refused(tmp_path, change, said):
    data = {**json.loads((TEMPLATES / "broker.json").read_text()), **change}
    (tmp_path / "b.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=said):
        stages.broker(str(tmp_path / "b.json"))
