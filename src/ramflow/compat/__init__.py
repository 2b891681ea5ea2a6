"""Compatibility layers: other libraries' APIs on ramflow's engine."""
