"""Side-by-side benchmarks: this exporter vs prometheus_client's multiprocess mode.

``python -m bench`` (``--help`` for the options).  Every measurement of ours
and of the reference runs in the same invocation, interleaved, in separate
worker processes, and is reported as a median with the ratio.  Nothing here
asserts on absolute times: the numbers are for the README and for humans.
"""
