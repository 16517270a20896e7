"""Experiments made of many training runs: the spatial-relation study."""
