"""Probe: what a 16 x 1 MiB MGET costs redis-server right after the values were stored, back to back, and after an
idle pause: wall time and the server's minor faults / CPU from /proc (session 42 scratch)."""
import os, shutil, socket, subprocess, sys, time, statistics
import redis
from replica.tiers.redis_tier import ReplyReader, reply_buffer

extra = sys.argv[1:]
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--save", "", "--appendonly", "no",
                         "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru", *extra], stdout=subprocess.DEVNULL)
time.sleep(0.5)
client = redis.Redis(port=port)
keys = [f"k{i}" for i in range(16)]

def stat():
    f = open(f"/proc/{proc.pid}/stat").read().split(")")[1].split()
    return int(f[7]), int(f[11]) + int(f[12])  # minflt, utime+stime ticks

buf = reply_buffer(2 << 20)
def mget():
    conn = client.connection_pool.get_connection()
    try:
        f0, c0 = stat(); t = time.perf_counter()
        conn.send_command("MGET", *keys)
        reader = ReplyReader(conn._sock, buf)
        n = reader.array_length()
        for _ in range(n):
            reader.bulk(4 << 20)
        dt = (time.perf_counter() - t) * 1e3
        f1, c1 = stat()
        return dt, f1 - f0, (c1 - c0) * 10
    finally:
        client.connection_pool.release(conn)

def store(seed):
    for k in keys:
        client.set(k, os.urandom(1 << 20))

store(0)
print("after store:", ["%.1f ms %d flt %d ms cpu" % mget() for _ in range(1)])
print("back to back:", ["%.1f/%d" % mget()[:2] for _ in range(8)])
for pause in (2, 12):
    time.sleep(pause)
    print(f"after {pause}s idle:", ["%.1f/%d" % mget()[:2] for _ in range(3)])
store(1)
print("after restore:", ["%.1f/%d" % mget()[:2] for _ in range(3)])
print("info:", client.info("memory")["mem_allocator"], client.config_get("jemalloc-bg-thread"))
proc.terminate()
