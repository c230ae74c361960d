"""hydra-trio tests."""
