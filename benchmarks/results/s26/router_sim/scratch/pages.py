import os, dataclasses
from benchmarks.router_sim import workloads as W
N = int(os.environ.get('X_PAGES', '0'))
if N:
    for name, fn in list(W.WORKLOADS.items()):
        def wrap(*a, _fn=fn, **k):
            w = _fn(*a, **k); w.num_pages_per_replica = N; return w
        W.WORKLOADS[name] = wrap
if os.environ.get('X_SLRU') == '1':
    import slru  # noqa
