"""Prototype tier: code kept for sweeps and A/B comparisons, not supported API.

Nothing in ``gem_jagged``'s production paths imports from here, and names here may change or
go without notice. Each sub-package says which production op it varies and why it is kept.
"""
