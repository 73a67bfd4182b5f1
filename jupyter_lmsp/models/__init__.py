"""Model directories: the tiny random-weight test model (and later the registry and imports)."""
