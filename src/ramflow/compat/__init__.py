"""Compatibility layers: other libraries' APIs on ramflow's engine.

May import: the public surface (``ramflow``) and every folder below it.
"""
