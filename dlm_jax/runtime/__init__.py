"""The NumPy-only host runtime: commit rules, schedules and decode loops (no JAX import)."""
