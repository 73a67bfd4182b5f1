"""The package version (a leaf module: anything may read it without importing the package)."""

__version__ = "0.1.0"
