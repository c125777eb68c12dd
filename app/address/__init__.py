"""The address server: the one process that serves a scrape address for the job (app.address.server).

A rank that wins the election starts it and then holds nothing of it; see docs/architecture.md.
"""
