"""contract-notes-on-Ray: trade dumps in, signed and e-mailed contract notes out."""

__version__ = "0.6.0"  # round 6: a day that survives losing a node
