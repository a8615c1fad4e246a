"""The capacity watch's decisions, on a fake clock and a scripted cluster view (pure logic;
the same watch runs against a cloud that refuses spot in tests/test_ray_up.py)."""

import logging

import pytest
import yaml

from pipeline.cluster.capacity import LOOK_AGAIN_S, CapacityError, CapacityWatch, ClusterView
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
    views = iter([ClusterView({"signer": 8, "smtp": 4}, set(), [(0, "render_spot launch failed (InsufficientInstanceCapacity)")])] * 100)
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
    views = iter([ClusterView({}, set(), [(0, "signer_smtp launch failed (VcpuLimitExceeded)")])] * 100)
    w, _ = watch(views, capacity_wait_s=100)
    for _ in range(10):
        w.check()
    with pytest.raises(CapacityError, match=r"no render/signer/smtp node came up in 100 s.*VcpuLimitExceeded"):
        w.check()


def test_once_every_role_has_a_node_the_watch_looks_again_only_every_few_seconds():
    now, views = [0.0], iter([ClusterView(EVERY_ROLE, set(), [])] * 2)
    w = CapacityWatch(lambda bundles: None, lambda: next(views), NODE_TYPES, 60, 0, clock=lambda: now[0])
    w.check()
    now[0] = LOOK_AGAIN_S - 1
    w.check()  # would raise StopIteration if it looked again
    now[0] = LOOK_AGAIN_S
    w.check()
    with pytest.raises(StopIteration):  # it looked
        now[0] = 2 * LOOK_AGAIN_S
        w.check()


def test_a_role_whose_last_node_is_lost_mid_day_on_a_ray_by_hand_is_waited_for_then_stops_the_run(caplog):
    """No autoscaler replaces a node of a Ray started by hand: without the watch looking again
    once every role had a node, the day's render tasks waited for ever (bench/node_loss.py's
    `--lose render --every`, in tests/test_node_loss.py)."""
    views = iter([ClusterView(EVERY_ROLE, set(), [])] * 3 + [ClusterView({"signer": 1, "smtp": 1}, set(), [])] * 100)
    w, _ = watch(views, 30, 30, node_types={})
    for _ in range(3):  # 0..20 s: every role
        w.check()
    w.check()  # 30 s: render gone
    assert w.gone == {"render": 30} and "offers render any more; waiting 30 s" in caplog.text and "--resources=" in caplog.text
    for _ in range(2):  # 40, 50 s
        w.check()
    with pytest.raises(CapacityError, match=r"offers render after 30 s .*what was mailed is recorded"):
        w.check()


def test_a_lost_role_s_replacement_booting_is_waited_for_and_its_arrival_said(caplog):
    caplog.set_level(logging.INFO, "pipeline.cluster.capacity")
    views = iter([ClusterView(EVERY_ROLE, set(), [])] + [ClusterView({"signer": 8, "smtp": 4}, {"render_spot"}, [])] * 9
                 + [ClusterView(EVERY_ROLE, set(), [])])
    w, requests = watch(views, capacity_wait_s=30)
    w.ask(DAY)
    for _ in range(11):  # render lost at 10 s, its replacement booting past the waits, up at 100 s
        w.check()
    assert w.arrived and not w.ondemand and requests == [DAY]
    assert "the autoscaler has 30 s (CN_CAPACITY_WAIT_S) to replace it" in caplog.text
    assert "render has a node again, after 90 s waited for" in caplog.text and not w.gone


def test_a_lost_role_with_nothing_booting_stops_the_run_saying_what_was_mailed_is_recorded():
    views = iter([ClusterView(EVERY_ROLE, set(), [])] + [ClusterView({"render": 32}, set(), [])] * 100)
    w, _ = watch(views, capacity_wait_s=30)
    for _ in range(4):
        w.check()
    with pytest.raises(CapacityError, match=r"no signer/smtp node came up in 30 s.*what was mailed is recorded"):
        w.check()


@pytest.mark.parametrize("failed_at, said", [(-5, "no failed launch reported"), (5, "InsufficientInstanceCapacity"),
                                              (20, "InsufficientInstanceCapacity")])
def test_a_stop_quotes_a_failed_launch_only_from_after_the_role_was_lost(failed_at, said):
    """The morning's refused launch is not the evening's reason: a failure from before the
    role's loss is not quoted; one since the last look that saw the role's node (at 0 s; the
    loss is seen at 10 s) is."""
    refused = [(failed_at, "render_spot launch failed (InsufficientInstanceCapacity)")]
    views = iter([ClusterView(EVERY_ROLE, set(), refused)] + [ClusterView({"signer": 8, "smtp": 4}, set(), refused)] * 100)
    w, _ = watch(views, spot_wait_s=1000, capacity_wait_s=30)
    for _ in range(4):
        w.check()
    with pytest.raises(CapacityError, match=f"no render node came up in 30 s.*the autoscaler says: [^;]*{said}"):
        w.check()


def test_a_render_role_lost_when_no_task_waits_for_it_stops_nothing_nor_launches_on_demand():
    """A mail-bound day's tail, its rendering done: its render node reclaimed stops nothing
    (stopping would end the mailers mid-send); once a task waits for render again, it counts."""
    idle = ClusterView({"signer": 8, "smtp": 4}, set(), [], demanded={"signer", "smtp"})
    views = iter([ClusterView(EVERY_ROLE, set(), [])] + [idle] * 20
                 + [ClusterView({"signer": 8, "smtp": 4}, set(), [], demanded={"render"})] * 100)
    w, requests = watch(views, spot_wait_s=60, capacity_wait_s=100)
    w.ask(DAY)
    for _ in range(21):  # render gone from 10 s to 200 s, no task waiting for it
        w.check()
    assert w.gone == {"render": 200} and not w.ondemand and requests == [DAY]
    for _ in range(6):  # from 210 s a render task waits (a lost result made again): spot for 60 s
        w.check()
    assert w.ondemand and requests[-1] == [{"CPU": 32, "render": 32, "ondemand": 1}] * 3 + DAY[3:]
    for _ in range(3):
        w.check()
    with pytest.raises(CapacityError, match=r"no render node came up in 100 s"):  # 300 s
        w.check()


def test_a_role_nothing_waits_for_stops_nothing_even_with_no_wait_at_all(caplog):
    caplog.set_level(logging.INFO, "pipeline.cluster.capacity")
    views = iter([ClusterView(EVERY_ROLE, set(), [])]
                 + [ClusterView({"signer": 8, "smtp": 4}, set(), [], demanded={"signer"})] * 3
                 + [ClusterView({"signer": 8, "smtp": 4}, set(), [], demanded=None)])
    w, requests = watch(views, spot_wait_s=0, capacity_wait_s=0)  # CN_CAPACITY_WAIT_S=0: no wait for a role needed
    w.ask(DAY)
    for _ in range(4):
        w.check()
    assert w.gone == {"render": 30} and not w.ondemand and requests == [DAY]
    assert "no task waits for render now" in caplog.text
    with pytest.raises(CapacityError, match="no render node came up in 10 s"):  # its demand unknown: it counts
        w.check()


def test_two_roles_lost_at_different_times_are_each_waited_for_from_their_own_loss():
    views = iter([ClusterView(EVERY_ROLE, set(), [])] + [ClusterView({"signer": 1, "smtp": 1}, set(), [])] * 5
                 + [ClusterView({}, set(), [])] * 100)
    w, _ = watch(views, 30, 100, node_types={})
    for _ in range(11):  # render gone at 10 s, signer/smtp at 60 s
        w.check()
    assert w.gone == {"render": 10, "signer": 60, "smtp": 60}
    with pytest.raises(CapacityError, match=r"offers render after 100 s .*\{\"render\": N\}'"):  # 110 s
        w.check()


def test_only_the_on_demand_render_type_offers_the_fallback_resource():
    offering = {n for n, t in NODE_TYPES.items() if t["resources"].get("ondemand")}
    assert offering == {"render_ondemand"}
    assert "InstanceMarketOptions" not in NODE_TYPES["render_ondemand"]["node_config"]


def test_the_stop_names_only_the_roles_with_nothing_booting():
    views = iter([ClusterView({}, {"render_ondemand"}, [(0, "signer_smtp launch failed (VcpuLimitExceeded)")])] * 100)
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
