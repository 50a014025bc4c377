"""Host side: how a global batch lies on the devices: its plan (devices x micro-batch x
accumulation steps) on a grid of compiled shapes, the two halves, and a mesh's shardings."""
