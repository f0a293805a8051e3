"""gem_jagged."""
