"""The training engine: the Trainer and its settings, building a run, step records and hooks,
batch plans, layouts, compiled step programs and the in-graph train step."""
