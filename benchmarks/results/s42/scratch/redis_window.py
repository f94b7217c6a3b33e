"""Probe: 16 x 1 MiB read as one MGET against GETs pipelined W at a time (the server then holds at most W values'
reply buffers, which jemalloc recycles, instead of 16 MiB of fresh ones): wall time and redis-server's minor faults,
right after the values were stored, back to back, and after an idle pause (session 42 scratch)."""
import os, shutil, socket, subprocess, sys, time
import redis
from replica.tiers.redis_tier import ReplyReader, reply_buffer

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--save", "", "--appendonly", "no",
                         "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL)
time.sleep(0.5)
client = redis.Redis(port=port)
N = 16

def stat():
    f = open(f"/proc/{proc.pid}/stat").read().split(")")[1].split()
    return int(f[7])

buf = reply_buffer(2 << 20)
def read(keys, window):
    conn = client.connection_pool.get_connection()
    try:
        f0 = stat(); t = time.perf_counter()
        reader = ReplyReader(conn._sock, buf)
        if window == 0:
            conn.send_command("MGET", *keys)
            for _ in range(reader.array_length()):
                reader.bulk(4 << 20)
        else:
            conn.send_packed_command(conn.pack_commands([("GET", k) for k in keys[:window]]))
            for i in range(len(keys)):
                reader.bulk(4 << 20)
                if i + window < len(keys):
                    conn.send_packed_command(conn.pack_command("GET", keys[i + window]))
        return (time.perf_counter() - t) * 1e3, stat() - f0
    finally:
        client.connection_pool.release(conn)

gen = 0
def store():
    global gen
    gen += 1
    keys = [f"g{gen}k{i}" for i in range(N)]
    for k in keys:
        client.set(k, os.urandom(1 << 20))
    return keys

for window in [int(w) for w in sys.argv[1].split(",")]:
    fresh, b2b, idle = [], [], []
    for rep in range(3):
        keys = store()
        fresh.append(read(keys, window))
        b2b.extend(read(keys, window) for _ in range(3))
        time.sleep(11)
        idle.append(read(keys, window))
    fmt = lambda xs: " ".join("%.1f/%d" % x for x in xs)
    print(f"window {window or 'MGET'}: fresh {fmt(fresh)} | back to back {fmt(b2b)} | after 11 s {fmt(idle)}",
          flush=True)
proc.terminate()
