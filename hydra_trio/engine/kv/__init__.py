"""A slot's KV cache as a blob: the blob format, save and restore (:mod:`.state`), the buffers blobs
travel in (:mod:`.blobbuf`) and the KV identity that decides which models may exchange them
(:mod:`.kv_identity`)."""
