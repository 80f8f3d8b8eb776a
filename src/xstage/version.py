"""The package version, on the ground floor so that every floor can name it in provenance."""

__version__ = "0.1.0"
