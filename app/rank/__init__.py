"""A rank's side: its Exporter, the recording entry points, its claim on the scrape address, and the serving
helper it starts (the supervisor here, the helper program in app.rank.helper).

Imported only by a rank: the standalone aggregator and the serving helper's own process never load
app.rank.exporter, app.rank.endpoint or app.rank.supervisor.
"""
