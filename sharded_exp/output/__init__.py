"""What a job leaves behind: result.json and the end-of-run table, the W&B run, the sweep report."""

TERMINAL_WIDTH = 100
"""The characters a line of a table printed to the terminal fits (the end-of-run table, the
plan's default table): a common terminal's width, where the full tables (about 190) wrap."""
