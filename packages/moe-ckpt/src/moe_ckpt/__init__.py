"""moe-ckpt."""
