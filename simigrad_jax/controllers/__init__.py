"""Host side: controllers that turn each step's measurements into the next global batch size."""
