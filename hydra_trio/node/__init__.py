"""The composition root: the server's nursery (listener, front door, protocols, engine, drain)."""
