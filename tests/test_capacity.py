"""The capacity watch's decisions, on a fake clock and a scripted cluster view (pure logic;
the same watch runs against a cloud that refuses spot in tests/test_ray_up.py)."""

import pytest
import yaml

from pipeline.cluster.capacity import CapacityError, CapacityWatch, ClusterView
from pipeline.settings import ROOT

NODE_TYPES = yaml.safe_load(open(f"{ROOT}/cluster.yaml"))["available_node_types"]
EVERY_ROLE = {"CPU": 40, "render": 32, "signer": 8, "smtp": 4}
DAY = [{"CPU": 32, "render": 32}] * 3 + [{"CPU": 8, "signer": 8, "smtp": 4}]


def watch(views, spot_wait_s=60, capacity_wait_s=600, node_types=NODE_TYPES):
    clock = iter(range(0, 10_000, 10))  # each check is ten seconds after the last
    requests = []
    w = CapacityWatch(requests.append, lambda: next(views), node_types, spot_wait_s, capacity_wait_s,
                      clock=lambda: next(clock))
    return w, requests


def test_spot_that_never_launches_is_replaced_by_on_demand_render_nodes_only():
    views = iter([ClusterView({"signer": 8, "smtp": 4}, set(), ["render_spot launch failed (InsufficientInstanceCapacity)"])] * 100)
    w, requests = watch(views)
    w.ask(DAY)
    for _ in range(6):  # 0..50 s: still waiting for spot
        w.check()
    assert requests == [DAY]
    w.check()  # 60 s
    assert w.ondemand
    assert requests[-1] == [{"CPU": 32, "render": 32, "ondemand": 1}] * 3 + [{"CPU": 8, "signer": 8, "smtp": 4}]
    w.ask(DAY[:1])  # the day's size known later: still on-demand
    assert requests[-1] == [{"CPU": 32, "render": 32, "ondemand": 1}]


def test_before_the_day_is_sized_the_fallback_asks_for_one_render_slot():
    views = iter([ClusterView({}, set(), [])] * 100)
    w, requests = watch(views, spot_wait_s=0)
    w.check()
    assert requests == [[{"CPU": 1, "render": 1, "ondemand": 1}]]


def test_a_spot_node_that_is_booting_is_waited_for():
    views = iter([ClusterView({"signer": 8, "smtp": 4}, {"render_spot"}, [])] * 10
                 + [ClusterView(EVERY_ROLE, set(), [])])
    w, requests = watch(views)
    w.ask(DAY)
    for _ in range(11):
        w.check()
    assert not w.ondemand and w.arrived and requests == [DAY]


def test_no_capacity_at_all_stops_the_run_with_the_autoscalers_reason():
    views = iter([ClusterView({}, set(), ["signer_smtp launch failed (VcpuLimitExceeded)"])] * 100)
    w, _ = watch(views, capacity_wait_s=100)
    for _ in range(10):
        w.check()
    with pytest.raises(CapacityError, match=r"no render/signer/smtp node came up in 100 s.*VcpuLimitExceeded"):
        w.check()


def test_once_every_role_has_a_node_the_watch_stops_looking():
    views = iter([ClusterView(EVERY_ROLE, set(), [])])
    w, _ = watch(views, capacity_wait_s=0)
    w.check()
    w.check()  # would raise StopIteration if it looked again
    assert w.arrived


def test_only_the_on_demand_render_type_offers_the_fallback_resource():
    offering = {n for n, t in NODE_TYPES.items() if t["resources"].get("ondemand")}
    assert offering == {"render_ondemand"}
    assert "InstanceMarketOptions" not in NODE_TYPES["render_ondemand"]["node_config"]


def test_the_stop_names_only_the_roles_with_nothing_booting():
    views = iter([ClusterView({}, {"render_ondemand"}, ["signer_smtp launch failed (VcpuLimitExceeded)"])] * 100)
    w, _ = watch(views, capacity_wait_s=30)
    for _ in range(3):
        w.check()
    with pytest.raises(CapacityError, match=r"no signer/smtp node came up in 30 s.*VcpuLimitExceeded"):
        w.check()


def test_a_ray_without_an_autoscaler_says_the_missing_role_at_once_and_stops_naming_how_to_offer_it(caplog):
    views = iter([ClusterView({"signer": 1, "smtp": 1}, set(), [])] * 100)
    w, _ = watch(views, 30, 30, node_types={})  # a Ray joined by its address: no node types known
    w.check()
    assert "no node of this Ray offers render yet; waiting 30 s" in caplog.text and "--resources=" in caplog.text
    w.check()
    w.check()
    with pytest.raises(CapacityError, match=r"no node of this Ray offers render after 30 s .*--resources='\{\"render\": N\}'"):
        w.check()


def test_a_ray_without_known_node_types_does_not_stop_while_a_node_boots():
    views = iter([ClusterView({}, {"some-type"}, [])] * 5 + [ClusterView({}, set(), [])] * 100)
    w, _ = watch(views, 30, 30, node_types={})  # a Ray joined by its address: no node types known
    for _ in range(5):  # 0..40 s: past the wait, a node booting
        w.check()
    with pytest.raises(CapacityError, match=r"offers render/signer/smtp after 50 s .*\{\"render\": N, \"signer\": N, \"smtp\": N\}"):
        w.check()
