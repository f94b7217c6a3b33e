"""ray.init with and without the dashboard (argv[1]: 1 or 0), and the first task after it."""
import sys, time, os
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
t0 = time.perf_counter()
import ray
t1 = time.perf_counter()
dash = sys.argv[1] == "1"
ray.init(include_dashboard=dash, _node_ip_address="127.0.0.1", logging_level="ERROR")
t2 = time.perf_counter()
@ray.remote
def f(): return 1
ray.get(f.remote())
t3 = time.perf_counter()
print(f"dash={dash} import {t1-t0:.2f} init {t2-t1:.2f} first task {t3-t2:.2f}")
ray.shutdown()
