"""Credentials (LMSP B3): tokens and codes and their hashes (`secrets`, a leaf module), callers
and their scopes, rate limits for credential-free requests. The pairing flow itself is a
service (`services.pairing`)."""
