"""Measurement and prediction of memory: what a rank holds, measured and predicted."""
