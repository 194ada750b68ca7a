"""Helpers shared by several test modules (no tests here): test modules import from these
modules and from ``tests.conftest``, never from one another."""
