"""Paired clients (LMSP B3): tokens and codes, scopes and callers, pairing, rate limits."""
