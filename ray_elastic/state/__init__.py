"""State that survives a lost slice: in-memory snapshots (and the keepers that hold them on each
host) and Orbax checkpoints."""
