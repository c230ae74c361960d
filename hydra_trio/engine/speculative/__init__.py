"""Speculative decoding: drafters that propose tokens the target model verifies in one batch."""
