"""gem_parallel."""
