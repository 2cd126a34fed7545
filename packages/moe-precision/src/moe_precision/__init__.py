"""moe-precision."""
