"""Cross-replica KV reuse: a Redis directory of who holds which prefix blocks, and peer-to-peer pulls."""
