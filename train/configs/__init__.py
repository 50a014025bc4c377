"""One config file per experiment; ``default.py`` holds every option and its default."""
