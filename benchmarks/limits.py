"""Time limits of the commands benchmarks run. Imports nothing: the benchmarks that time
startup and imports load it without loading torch."""

COMMAND_TIMEOUT_S = 3600
"""Seconds one command a benchmark runs (a job, a plan, an import) may take before it is
killed and the benchmark fails: far above any of them (the longest, a job on a loaded
2-core machine, takes minutes), so that only a hung one is stopped, instead of waiting
forever, or running on after a smoke test's own limit killed its benchmark."""
