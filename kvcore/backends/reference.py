"""Reference backend: plain NumPy in float64, the oracle for every kernel.

The float64 attention lives in ``backends/base.py`` beside the other
reference operations (``Backend.paged_attention`` runs it); this module
keeps the names the tests import.
"""
from .base import paged_attention_reference, stored_values

__all__ = ["paged_attention_reference", "stored_values"]
