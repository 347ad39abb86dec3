"""The package version, importable without importing the package's parts."""

__version__ = "0.1.0"
