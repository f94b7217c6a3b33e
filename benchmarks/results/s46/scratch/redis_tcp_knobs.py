"""Probe (session 46): 16 x 1 MiB GETs pipelined 2 ahead, read with the tier's ReplyReader, over TCP and a unix socket,
with the client's socket options as redis-py leaves them and with a few knobs turned (median ms of 30 reads)."""
import os, shutil, socket, statistics, subprocess, sys, tempfile, time
import redis
from replica.tiers.redis_tier import ReplyReader, reply_buffer

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
sock_path = os.path.join(tempfile.mkdtemp(), "r.sock")
proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--unixsocket", sock_path, "--save", "",
                         "--appendonly", "no", "--maxmemory", "2gb"] + sys.argv[1:], stdout=subprocess.DEVNULL)
time.sleep(0.5)
N, WINDOW = 16, 2
keys = [f"k{i}" for i in range(N)]
setup = redis.Redis(port=port)
for k in keys:
    setup.set(k, os.urandom(1 << 20))
buf = reply_buffer(2 << 20)

def read(client):
    conn = client.connection_pool.get_connection()
    try:
        t = time.perf_counter()
        reader = ReplyReader(conn._sock, buf)
        conn.send_packed_command(conn.pack_commands([("GET", k) for k in keys[:WINDOW]]))
        for i in range(N):
            reader.bulk(4 << 20)
            if i + WINDOW < N:
                conn.send_packed_command(conn.pack_command("GET", keys[i + WINDOW]))
        return (time.perf_counter() - t) * 1e3
    finally:
        client.connection_pool.release(conn)

def client_with(tweak=None, unix=False):
    c = redis.Redis(unix_socket_path=sock_path) if unix else redis.Redis(port=port, socket_read_size=1 << 20)
    conn = c.connection_pool.get_connection(); c.connection_pool.release(conn)
    if tweak:
        tweak(conn._sock)
    return c

variants = {
    "tcp (as the tier)": client_with(),
    "tcp SO_RCVBUF 8 MiB": client_with(lambda s: s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)),
    "tcp TCP_QUICKACK": client_with(lambda s: s.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)),
    "unix": client_with(unix=True),
}
results = {name: [] for name in variants}
for _ in range(30):
    for name, c in variants.items():
        results[name].append(read(c))
for name, xs in results.items():
    print(f"{name}: median {statistics.median(xs):.2f} ms, min {min(xs):.2f} ms "
          f"({16 * 1.048576 / statistics.median(xs):.2f} GB/s median)")
print("server's args:", sys.argv[1:] or "none")
proc.terminate()
