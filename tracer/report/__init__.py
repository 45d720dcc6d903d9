"""Reports of a comparison: terminal summary, JSON, plot."""
