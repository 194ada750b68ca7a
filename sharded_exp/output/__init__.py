"""What a job leaves behind: result.json and the end-of-run table, the W&B run, the sweep report."""
