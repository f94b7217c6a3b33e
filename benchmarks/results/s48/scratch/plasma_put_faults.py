"""Ray alone: ray.put of one 16 MiB array, 48 in a row with a 0.5 s pause after each 8, timing each put and counting
this process's minor page faults. OSM=BYTES caps the object store (default: Ray's, 30% of memory).
OSM=$((256<<20)) .venv/bin/python benchmarks/results/s48/scratch/plasma_put_faults.py"""
import os, time, resource, numpy as np, ray
ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", object_store_memory=int(os.environ.get("OSM", "0")) or None)
a = np.random.randint(0, 1 << 15, size=8 << 20, dtype=np.uint16)  # 16 MiB
refs = []
for i in range(48):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter(); r = ray.put(a); t1 = time.perf_counter()
    f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    print("%.2f ms %d faults" % ((t1 - t0) * 1e3, f1 - f0), end="; ")
    del r
    if i % 8 == 7: time.sleep(0.5); print()
