"""The training engine: the Trainer, its batch plans, layouts, compiled step programs and the in-graph train step."""
