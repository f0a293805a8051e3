"""gem_train."""
