"""Which relevance method to trust: every method scored on two-circles, where the circles are known (README.md)."""
