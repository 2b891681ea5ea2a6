"""Transfers: the copy streams (one H2D and one D2H stream per device, an event for every
copy), pinned and shared host allocations, and the page-locked bytes ramflow holds.

May import: ``io``, ``units``, ``formats``, ``kernels``, ``ramflow.sizes``.
"""
