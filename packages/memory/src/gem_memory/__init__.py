"""gem_memory."""
