"""gem_lowprec."""
