"""Policies chosen from the config: the scaling policy of each mode (the next world, when to grow
back, the world sizes), the failure policy (which slices are lost, and whether to try again) and
the snapshot policy (how often a world snapshots its state)."""
