"""Observability: the event bus, progress of long steps, node statistics and logging."""
