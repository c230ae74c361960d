"""Clients of a running node that are not protocol libraries: ``hydra-trio watch``."""
