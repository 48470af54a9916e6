"""The slice process: the thin Ray actor that runs the task's JAX code (join a world, restore,
step, save), the compiled programs, and the data it feeds."""
