"""Every private Ray API the project calls, in one place.

Ray promises nothing about `ray._raylet`, `ray._private` or `ray.autoscaler._private` from one
release to the next, and some of what a day needs exists only there: draining a node as the
autoscaler does (the spot notice), the nodes being drained (the pools), the cluster's node
provider from its config (the head's end, `watch`, enrolment), the token header `ray job` sends.
Each is wrapped here and nowhere else, and `USED` names the shape each wrapper relies on:
tests/test_ray_private.py checks it against the installed Ray and pins `TESTED_RAY`, so an upgrade
trips a test, not a night's drain that fails quietly.
"""

from __future__ import annotations

TESTED_RAY = "2.60.0"  # requirements.in's pin; the shapes below were read from this version's source
ALIVE = 0  # gcs_pb2.GcsNodeInfo.GcsNodeState.ALIVE

# The private callables used, and the parameters each is called with (in order)
USED = {
    "ray._raylet.InnerGcsClient.drain_node": ["self", "node_id", "reason", "reason_message",
                                              "deadline_timestamp_ms", "timeout"],
    "ray._raylet.InnerGcsClient.get_all_node_info": ["self", "timeout", "node_selectors", "state_filter"],
    "ray._private.state.GlobalState.get_draining_nodes": ["self"],
    "ray.autoscaler._private.commands._bootstrap_config": ["config", "no_config_cache"],
    "ray.autoscaler._private.providers._get_node_provider": ["provider_config", "cluster_name", "use_cache"],
    "ray._private.authentication.http_token_authentication.get_auth_headers_if_auth_enabled": ["user_headers"],
}


def gcs_client(gcs_address: str):
    """A client of the head's GCS at HOST:PORT (what `ray drain-node` makes; its calls are
    InnerGcsClient's)."""
    import ray._raylet

    return ray._raylet.GcsClient(address=gcs_address)


def node_id_at(gcs_address: str, ip: str, timeout_s: float = 10.0) -> str:
    """The id (hex) of the alive Ray node whose raylet is at `ip`."""
    for node_id, info in gcs_client(gcs_address).get_all_node_info(timeout=timeout_s).items():
        if info.node_manager_address == ip and info.state == ALIVE:
            return node_id.hex()
    raise LookupError(f"no alive Ray node at {ip} in {gcs_address}")


def drain_node(gcs_address: str, node_id: str, message: str, deadline_ms: int,
               timeout_s: float = 10.0) -> tuple[bool, str]:
    """Drains the node as autoscaler v2 does on preemption (reason PREEMPTION: the raylet cannot
    refuse it); the GCS's (accepted, why not)."""
    from ray.core.generated import autoscaler_pb2

    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    return gcs_client(gcs_address).drain_node(node_id, reason, message, deadline_ms, timeout=timeout_s)


def draining_nodes() -> set[str]:
    """The nodes (hex ids) the connected cluster's GCS is draining."""
    import ray._private.state

    return set(ray._private.state.state.get_draining_nodes())


def node_provider(cfg: dict):
    """The cluster's node provider for a cluster config (a dict), bootstrapped as `ray up` does."""
    from ray.autoscaler._private.commands import _bootstrap_config
    from ray.autoscaler._private.providers import _get_node_provider

    cfg = _bootstrap_config(cfg, no_config_cache=True)
    return _get_node_provider(cfg["provider"], cfg["cluster_name"])


def job_api_headers() -> dict:
    """The headers `ray job` sends the dashboard: the cluster's token when RAY_AUTH_MODE=token."""
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled

    return get_auth_headers_if_auth_enabled({})
