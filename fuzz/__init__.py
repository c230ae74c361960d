"""Hypothesis strategies and fuzzers for hydra-trio."""
