"""A node provider for the tests that has one head node and records what it is asked to end."""

from __future__ import annotations

import json
import os

from ray.autoscaler.node_provider import NodeProvider
from ray.autoscaler.tags import NODE_KIND_HEAD, TAG_RAY_NODE_KIND


class RecordingProvider(NodeProvider):
    def non_terminated_nodes(self, tag_filters):
        return ["head-1"] if tag_filters.get(TAG_RAY_NODE_KIND) == NODE_KIND_HEAD else []

    def terminate_nodes(self, node_ids):
        with open(os.environ["CN_RECORDED_TERMINATIONS"], "a") as f:
            f.write(json.dumps(node_ids) + "\n")
