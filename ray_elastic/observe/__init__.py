"""What a run reports: the event log, per-step results and records, goodput, the report and its
plot, Ray metrics, TensorBoard, and the listeners (progress bar, user callbacks)."""
