"""Speculative decoding: drafters that propose tokens the target model verifies in one batch.

* :mod:`.base`: the drafter contract (llama.cpp's ``common_speculative_impl``);
* :mod:`.settings`: ``--spec-type`` and the ``--spec-*`` parameters as data (:data:`.settings.SPEC_OPTIONS`);
* :mod:`.combine`: several drafters as one (``common_speculative``), :func:`.combine.make_speculative`;
* llama-server's model-free types: :mod:`.ngram_map` (``ngram-simple``, ``ngram-map-k``, ``ngram-map-k4v``),
  :mod:`.ngram_mod` (``ngram-mod``), :mod:`.ngram_cache` (``ngram-cache`` and the lookup-cache files);
* :mod:`.suffix`: hydra-trio's ``suffix`` type (SuffixDecoding).
"""
