"""Utilities built on the global tensor API.

``globaltensor.utils.data``: a sharding sampler and a loader that yields split(0) global
batches, each rank loading only its own rows.
"""
from . import data

__all__ = ["data"]
