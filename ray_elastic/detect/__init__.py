"""Failure evidence: a process's death seen by its liveness connection closing, error kinds, dead
nodes, raylets that refuse, health probes."""
