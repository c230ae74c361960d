"""What reads a peer's values: strict JSON to attrs classes (strict.py), ``host:port`` addresses (address.py).

Sans-I/O, above the codecs and the errors: every refusal is a :class:`~hydra_trio.validation.strict.MessageError`."""
