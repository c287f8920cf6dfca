"""Reliability tests: the chaos soak at CI size and the poison fuzz (docs/reliability.md)."""
