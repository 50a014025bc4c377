"""Host side: data sources, the epoch sampler and readers that decode examples ahead."""
