"""The actor pools' sizing and dispatch, with plain objects for actors (pure logic; the pools
on Ray's autoscaler are in test_autoscaler.py)."""

import pytest

from pipeline.cluster.pools import Pool


def pool():
    killed = []
    return Pool("signer", lambda i: f"actor-{i}", killed.append), killed


def test_the_pool_grows_to_the_slots_and_keeps_one_actor_when_there_are_none():
    p, _ = pool()
    p.size_to(0)
    assert p.actors == ["actor-0"]
    p.size_to(3)
    assert p.actors == ["actor-0", "actor-1", "actor-2"] and p.peak == 3


def test_each_call_goes_to_the_least_loaded_actor_not_round_robin():
    p, _ = pool()
    p.size_to(3)
    first, second, third = p.take(), p.take(), p.take()
    assert {first, second, third} == set(p.actors)
    p.give_back(second)
    assert p.take() == second  # the only idle one, whatever the order
    p.give_back(first)
    p.give_back(third)
    p.give_back(second)
    assert p.busy == [0, 0, 0]


def test_shrinking_gives_back_only_idle_actors_and_names_stay_unique():
    p, killed = pool()
    p.size_to(3)
    busy = p.take()
    p.size_to(1)  # a node went: two slots fewer
    assert busy in p.actors and len(p.actors) == 1 and len(killed) == 2
    p.size_to(2)
    assert p.actors[-1] == "actor-3", "a new actor never reuses a name"


def located():
    """A pool whose actors say where they run only when told (the probe is the actor's name)."""
    killed = []
    return Pool("mailer", lambda i: f"actor-{i}", killed.append, lambda actor: f"where-{actor}"), killed


def test_an_actor_is_chosen_only_once_it_has_said_which_node_it_runs_on():
    p, _ = located()
    p.size_to(2)
    assert not p.ready() and p.starting() == {"where-actor-0": "actor-0", "where-actor-1": "actor-1"}
    p.placed(p.actors[1], "node-b")
    assert p.ready() and [p.take(), p.take()] == ["actor-1", "actor-1"], "the one still starting is never chosen"
    assert p.starting() == {"where-actor-0": "actor-0"}


def test_the_actors_of_a_lost_node_are_dropped_and_never_chosen_again():
    p, killed = located()
    p.size_to(3)
    for actor, node in zip(p.actors, "abb"):
        p.placed(actor, node)
    busy = p.take()
    assert p.lose_nodes({"b"}) == ["actor-1", "actor-2"] and p.lost == 2
    assert killed == ["actor-1", "actor-2"] and p.actors == ["actor-0"]
    assert {p.take() for _ in range(3)} == {"actor-0"} and busy in ("actor-0", "actor-1")
    p.size_to(3)  # the node's replacement: new actors, new names, chosen once placed
    assert p.actors == ["actor-0", "actor-3", "actor-4"] and p.starting() == {
        "where-actor-3": "actor-3", "where-actor-4": "actor-4"}


def test_a_draining_node_s_actors_are_chosen_no_more_and_go_once_idle():
    p, killed = located()
    p.size_to(2)
    p.placed(p.actors[0], "a")
    p.placed(p.actors[1], "b")
    while p.take() != "actor-1":
        pass
    assert p.drain({"b"}) == 1 and p.drain({"b"}) == 0
    assert {p.take() for _ in range(4)} == {"actor-0"}
    p.size_to(1)
    assert "actor-1" in p.actors and killed == [], "a busy one finishes its batch"
    p.give_back(p.actors[1])
    p.size_to(1)
    assert p.actors == ["actor-0"] and killed == ["actor-1"]


def test_with_every_actor_lost_there_is_none_to_take():
    p, _ = located()
    p.size_to(1)
    p.placed(p.actors[0], "a")
    p.lose_nodes({"a"})
    assert not p.ready()
    with pytest.raises(LookupError):
        p.take()


def test_the_fleet_drops_a_lost_node_s_actors_counts_lost_and_drained_nodes_and_stops_a_role_left_empty(caplog):
    from pipeline.cluster.capacity import CapacityError
    from pipeline.cluster.fleet import PREEMPTED, Fleet, NodeView

    mailers, _ = located()
    mailers.size_to(2)
    mailers.placed(mailers.actors[0], "a")
    mailers.placed(mailers.actors[1], "b")
    now = [0.0]
    fleet = Fleet((mailers,), capacity_wait_s=60, clock=lambda: now[0])
    fleet.check(NodeView(frozenset({"a", "b", "r"}), frozenset(), {}, {"old": 2}))  # one ended before the run
    fleet.check(NodeView(frozenset({"a", "r"}), frozenset({"r"}), {}, {"old": 2, "b": 2}))  # b lost, r draining
    assert mailers.actors == ["actor-0"] and fleet.counts() == {"lost": 1, "drained": 1, "actors_lost": 1}
    fleet.check(NodeView(frozenset(), frozenset(), {}, {"old": 2, "b": 2, "r": PREEMPTED, "a": 2}))
    assert fleet.counts() == {"lost": 2, "drained": 1, "actors_lost": 2}, "a drained node's end is no loss"
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if "drained (a spot notice)" in m] == ["node(s) r drained (a spot notice): no new work goes there"]
    assert sum("lost: their actors are dropped" in m for m in said) == 2, said
    now[0] = 59
    fleet.check(NodeView(frozenset(), frozenset(), {}, {}))
    now[0] = 61
    with pytest.raises(CapacityError, match="no mailer actor has been alive for 61 s"):
        fleet.check(NodeView(frozenset(), frozenset(), {}, {}))


def test_counting_a_lost_node_where_no_ray_runs_starts_no_ray():
    """The test above counts nodes in the test's own process: Ray's first call there started a Ray
    of its own, without the role resources, and a day run later in that process used it and
    waited for ever on its split's tasks (381159f's suite, where a day's test had lost its
    ray_session fixture and ran in the quick lane after it)."""
    import os
    import subprocess
    import sys

    from pipeline.settings import ROOT

    code = ("from actors import metrics; metrics.nodes('lost', 1); metrics.day({'ok': 1}); import ray; "
            "print(ray.is_initialized())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"
