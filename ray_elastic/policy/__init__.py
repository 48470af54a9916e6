"""Policies chosen from the config: the scaling policy of each mode (the next world, when to grow
back, the world sizes) and the failure policy (which slices are lost, and whether to try again)."""
