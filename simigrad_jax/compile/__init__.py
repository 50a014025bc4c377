"""Host side: a step's compiled programs: ahead-of-time and background compiles, the fallback shape
while one compiles, agreement on compiles across hosts, JAX's persistent compilation cache."""
