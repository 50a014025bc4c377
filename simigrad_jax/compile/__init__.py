"""Host: a step's compiled programs: its jitted functions, ahead-of-time and background compiles
and their order, the fallback shape while one compiles, agreement on compiles across hosts, JAX's
persistent compilation cache, and running a step on the programs."""
