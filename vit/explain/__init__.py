"""Looking inside: relevance maps (attention rollout and friends), their overlays, their dashboard callback."""
