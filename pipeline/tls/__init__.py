"""The cluster's own CA (ca) and the workers' enrollment with it (enroll): security plumbing as
a small leaf, importing nothing of the pipeline but its settings. No Ray."""
