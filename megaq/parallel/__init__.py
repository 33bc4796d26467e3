"""Parallel building blocks: rank topology, the collective layer, TP layers, pipeline."""
