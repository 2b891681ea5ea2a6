"""Units: the sets of modules whose parameters move together.

Owns finding units in a model (``find_units``: usually one transformer block each; the
embedding, final norm and head are units of their own), their runtime record (``Unit``), the
ranges of the routed experts inside a unit (``experts``), and the registry that says which
engine owns a model or a parameter without keeping either alive.

May import: ``formats``, ``kernels``, ``ramflow.sizes``.
"""
