"""The Ray fan-out and the cluster's life: the driver, the actor pools, the split's tasks,
capacity and the plan, and recovery that reads across packages (restore, reconcile). The only
package of pipeline/ that imports Ray, besides the actors."""
