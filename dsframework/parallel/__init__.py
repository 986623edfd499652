"""Parallel layouts: the rank grid (topology), tensor-parallel layers, pipeline stages."""
