"""The threads the pipelines run on: helpers that split one call's work (fork/join) and
background workers fed through queues.
"""
