__version__ = "0.32.0"
