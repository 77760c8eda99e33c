"""The ops dashboard: a page served by the router (/dashboard) and its live data.

history  the 15-minute ring of one-second samples (rates, latency percentiles, KV, GB/s)
sampler  the asyncio task that fills it from the router's own counters
state    the cluster now: roles, workers and their KV bars, capacity, queue, rejections
paths    its URLs (the API key guard exempts only the page and its static files)
http     the routes; static/ holds the page, its script and style, and the vendored uPlot
"""
