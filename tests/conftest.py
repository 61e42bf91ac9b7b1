from hypothesis import settings

# Fixed seeds: every hypothesis test is derandomized so CI runs are reproducible.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("ci")
