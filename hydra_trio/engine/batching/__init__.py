"""Continuous batching on the engine thread: the scheduler (:mod:`.scheduler`: the slots, the queue, one
``llama_batch`` per step), the per-slot token handling (:mod:`.generation`, llama-server's ``server_slot``),
the slots and stop strings (:mod:`.slots`), sampler chains (:mod:`.sampling`, :mod:`.gbnf_depth`,
:mod:`.thinking_budget`) and what keeps or moves a slot's KV cells between requests (:mod:`.kv_cells`,
:mod:`.checkpoints`, :mod:`.prompt_cache`)."""
