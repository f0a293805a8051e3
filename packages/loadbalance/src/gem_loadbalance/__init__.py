"""gem_loadbalance."""
