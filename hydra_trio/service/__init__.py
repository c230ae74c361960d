"""What every front end (HTTP, Hydra) calls: prepare a completion and the plan of its reply, save and restore
a slot, the node's facts, embeddings.  Front ends decode, route and encode; the use cases are here, once."""
