"""The actor pools' sizing and dispatch, with plain objects for actors (pure logic; the pools
on Ray's autoscaler are in test_autoscaler.py)."""

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
