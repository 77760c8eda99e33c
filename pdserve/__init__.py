"""pdserve: command line, launchers and shared settings."""

__version__ = "0.1.0"
