"""Code that runs inside jit / pmap / shard_map: pure, traced, no host decisions."""
