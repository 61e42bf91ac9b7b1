"""Helpers the test folders share (no test module imports another test module for them)."""
