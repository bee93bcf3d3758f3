"""Renamed ``partials.py``."""
from .partials import identity_value  # noqa: F401  dispatch imports it from here
