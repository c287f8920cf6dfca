"""publisher package."""
