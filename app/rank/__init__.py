"""A rank's side: its Exporter, the recording entry points, its claim on the scrape address, and the start of
the address server (whose program is app.address.server).

Imported only by a rank: the standalone aggregator and the address server never load it.
"""
