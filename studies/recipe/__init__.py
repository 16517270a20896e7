"""The recipe study: a ViT that learns the same-different relation every time (README.md)."""
