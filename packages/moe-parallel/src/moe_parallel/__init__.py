"""moe-parallel."""
