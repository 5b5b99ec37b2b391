"""Stand-in for flash-attn's padding helpers on CPU test machines (see ../README.md)."""
