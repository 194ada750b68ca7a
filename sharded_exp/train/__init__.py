"""The rank side's work: the training loop, its metrics, and fault injection for tests."""
