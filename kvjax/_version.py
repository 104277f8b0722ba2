"""The package version, importable without the package (saved states record it)."""

__version__ = "0.1.0"
