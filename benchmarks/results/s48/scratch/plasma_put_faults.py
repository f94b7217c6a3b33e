import os, time, resource, numpy as np, ray
ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
a = np.random.randint(0, 1 << 15, size=8 << 20, dtype=np.uint16)  # 16 MiB
refs = []
for i in range(24):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter(); r = ray.put(a); t1 = time.perf_counter()
    f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    print("%.2f ms %d faults" % ((t1 - t0) * 1e3, f1 - f0), end="; ")
    del r
    if i % 8 == 7: time.sleep(0.5); print()
