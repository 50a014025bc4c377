"""In-graph: the collectives behind ``simigrad_jax.transform``, pure and traced.

They reduce the devices' gradients to their mean and measure the two halves'
statistics (``<g_A, g_B>``, ``|g_A|^2``, ``|g_B|^2``) from which the
similarity follows: ``halves_reduction`` (the ``"hierarchical"``,
``"scatter"`` and ``"stacked"`` collectives of a mapped step),
``group_reduction`` (the device split's reduction on each device's own shards
under Auto mesh axes), ``half_statistics`` (the float32 statistics of two
halves, of pieces or of global sharded gradients) and ``data_blocks``
(parameters kept in blocks over the data axis, FSDP). Nothing here is called
by a user directly: ``simigrad_jax.transform`` and the steps of
``simigrad_jax.ingraph`` do.
"""

__all__: list[str] = []  # the transform and the steps call these; nothing here is a user's
