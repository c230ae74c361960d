"""Helpers for tests and benches (never imported by product code)."""
