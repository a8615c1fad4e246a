"""The private Ray calls the project makes, pinned (issue 69): each lives in
pipeline/cluster/ray_private.py, and each still has the shape it is called with on the installed
Ray. A Ray upgrade fails here first: read the new Ray's source for each, then move TESTED_RAY."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
from pathlib import Path

import pytest

from pipeline.cluster import ray_private
from pipeline.settings import ROOT


def _resolve(dotted: str):
    """`pkg.module.Class.attr` -> the object, importing the longest module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(dotted)


def test_the_installed_ray_is_the_one_the_private_calls_were_read_from():
    import ray

    assert ray.__version__ == ray_private.TESTED_RAY, (
        f"Ray {ray.__version__}: check each of ray_private.USED in its source, then set TESTED_RAY")
    pinned = re.search(r"^ray\[default\]==(\S+)$", (Path(ROOT) / "requirements.in").read_text(), re.M).group(1)
    assert pinned == ray_private.TESTED_RAY


@pytest.mark.parametrize("dotted", sorted(ray_private.USED))
def test_each_private_call_has_the_parameters_it_is_called_with(dotted):
    assert list(inspect.signature(_resolve(dotted)).parameters) == ray_private.USED[dotted]


def test_what_the_wrappers_read_of_rays_answers_is_still_there():
    from ray.core.generated import autoscaler_pb2, gcs_pb2

    assert autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    assert gcs_pb2.GcsNodeInfo.GcsNodeState.Value("ALIVE") == ray_private.ALIVE
    assert {"node_manager_address", "state"} <= set(gcs_pb2.GcsNodeInfo.DESCRIPTOR.fields_by_name)
    assert hasattr(_resolve("ray._private.state"), "state")  # the connected driver's GlobalState


def test_no_other_module_of_the_project_reaches_into_rays_private_parts():
    found = subprocess.run(["grep", "-rnE", r"ray\._private|ray\._raylet|autoscaler\._private|GcsClient",
                            "pipeline", "actors", "scripts", "bench", "--include=*.py"],
                           cwd=ROOT, capture_output=True, text=True).stdout.splitlines()
    assert [line for line in found if not line.startswith("pipeline/cluster/ray_private.py:")] == []
