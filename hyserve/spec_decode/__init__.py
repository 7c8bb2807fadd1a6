"""Speculative decoding: config, drafters, verification (docs/speculative_decoding.md)."""
