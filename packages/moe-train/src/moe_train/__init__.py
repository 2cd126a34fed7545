"""moe-train."""
