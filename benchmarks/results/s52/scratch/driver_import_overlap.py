"""The driver's imports against ray.init: argv[1] serial (cluster.app before ray.init) or thread (torch and Dynamo
imported in a thread during ray.init; the whole app in an earlier variant). .venv/bin/python THIS serial|thread"""
import sys, time, os, threading
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, "/work/main")
t0 = time.perf_counter()
import ray
from ray import serve
mode = sys.argv[1]
th = None
if mode == "thread":
    th = threading.Thread(target=lambda: (__import__("torch"), __import__("torch._dynamo")))
    th.start()
elif mode == "serial":
    import cluster.app
t1 = time.perf_counter()
ray.init(_node_ip_address="127.0.0.1", logging_level="ERROR")
t2 = time.perf_counter()
if th: th.join()
import cluster.app
t3 = time.perf_counter()
print(f"{mode}: before init {t1-t0:.2f} init {t2-t1:.2f} join {t3-t2:.2f} total {t3-t0:.2f}")
ray.shutdown()
