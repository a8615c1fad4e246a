"""The Ray fan-out and the cluster's life: the driver, the actor pools, the split's tasks,
capacity and the plan, and the reaper of a local run's processes. The only package of
pipeline/ that imports Ray, besides the actors; what happens to a run after its day is in
pipeline/followup, the cluster's certificates in pipeline/tls."""
