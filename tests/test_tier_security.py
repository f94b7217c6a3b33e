"""Shared-tier data at rest and hostile stores: only regular files are read, files 0600 in 0700 folders, one budget for
every writer of a folder, chain tails evicted before their parents, nothing of the prompt readable at rest, a Redis
started by us needs its password and dies with its parent (real files, real processes, a real redis-server)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis

from replica.tiers.arrow_file import write_page_file
from replica.tiers.disk_tier import DiskTier
from replica.tiers.redis_tier import RedisTier
from replica.tiers.seal import TierKey, create_key_file, load_key_file
from test_tiers import assert_bit_identical, keys_of, make_format, make_pages, tokens_of

ROOT = Path(__file__).resolve().parent.parent
SECRET = b"test-only secret of the cluster key, 32+ bytes"


def chain_pages(page_format, num_pages, seed):
    """Consecutive pages of one prompt with their parent keys (as the fetcher stores them)."""
    pages = make_pages(page_format, num_pages, seed=seed)
    import dataclasses

    return [dataclasses.replace(page, parent_key=pages[index - 1].key if index else None)
            for index, page in enumerate(pages)]


def file_size_of(page_format) -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        size, _ = write_page_file(os.path.join(folder, "p.arrow"), make_pages(page_format, 1)[0], TierKey(SECRET))
    return size


@pytest.fixture
def disk(tmp_path):
    tiers = []

    def make(**kwargs):
        kwargs.setdefault("budget_bytes", 1 << 30)
        kwargs.setdefault("tier_key", TierKey(SECRET))
        tier = DiskTier(tmp_path / "kv", make_format(), **kwargs)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def page_files(root) -> dict[str, int]:
    """Every page file under ``root`` -> its size."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(".arrow") and not name.startswith("."):
                path = os.path.join(folder, name)
                found[path] = os.lstat(path).st_size
    return found


# ---- only regular files are read -------------------------------------------------------------------------------


def plant_fifo(path):
    os.mkfifo(path)


def plant_symlink_to_dev_zero(path):
    os.symlink("/dev/zero", path)


def plant_symlink_to_a_real_page(path):
    other = path + ".elsewhere"
    os.rename(path, other)  # a genuine page file, but reached through a link
    os.symlink(other, path)


def plant_device(path):
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
    except PermissionError:
        pytest.skip("mknod needs root (CAP_MKNOD)")


def plant_socket(path):
    import socket
    import tempfile

    short = os.path.join(tempfile.mkdtemp(), "s")  # AF_UNIX paths are short: bind there, then move it into place
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(short)
    sock.close()
    os.rename(short, path)


@pytest.mark.parametrize("plant", [plant_fifo, plant_symlink_to_dev_zero, plant_symlink_to_a_real_page, plant_device,
                                   plant_socket], ids=lambda f: f.__name__.removeprefix("plant_"))
def test_only_regular_files_are_read(disk, plant):
    tier = disk()
    pages = chain_pages(tier.page_format, 3, seed=1)
    tier.store(pages)
    assert tier.flush(timeout=10)
    path = tier.page_path(pages[1].key)
    if plant is not plant_symlink_to_a_real_page:
        os.unlink(path)
    plant(path)
    result = {}
    reader = threading.Thread(target=lambda: result.update(loaded=tier.load(keys_of(pages), tokens_of(pages))))
    reader.start()
    reader.join(timeout=10)

    assert not reader.is_alive(), "load blocked on a non-regular file"
    assert_bit_identical(result["loaded"], pages[:1])
    stats = tier.stats()
    assert (stats.discarded_corrupt, stats.pages_loaded) == (1, 1)
    assert not os.path.lexists(path)  # the planted entry is removed (a symlink itself, never its target)
    assert os.path.exists("/dev/zero")


def test_oversized_file_is_rejected_before_it_is_read(disk):
    tier = disk()
    pages = chain_pages(tier.page_format, 1, seed=2)
    path = tier.page_path(pages[0].key)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with open(path, "wb") as file:
        file.truncate(1 << 30)  # sparse 1 GiB: reading it would take seconds and a GiB of memory

    assert tier.load(keys_of(pages), tokens_of(pages)) == []
    assert tier.stats().discarded_corrupt == 1 and not os.path.exists(path)


# ---- modes -----------------------------------------------------------------------------------------------------


def test_files_are_0600_in_0700_folders_and_a_loose_root_is_tightened(tmp_path):
    root = tmp_path / "kv"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    tier = DiskTier(root, make_format(), budget_bytes=1 << 30, tier_key=TierKey(SECRET))
    try:
        tier.store(chain_pages(tier.page_format, 3, seed=3))
        assert tier.flush(timeout=10)
        modes = {}
        for folder, subfolders, names in os.walk(root):
            modes[folder] = stat.S_IMODE(os.stat(folder).st_mode)
            for name in names:
                modes[os.path.join(folder, name)] = stat.S_IMODE(os.lstat(os.path.join(folder, name)).st_mode)
    finally:
        tier.close()
    folders = {path: mode for path, mode in modes.items() if os.path.isdir(path)}
    files = {path: mode for path, mode in modes.items() if not os.path.isdir(path)}
    assert len(folders) >= 3 and set(folders.values()) == {0o700}  # root, dtype, fan-out folders
    assert sum(path.endswith(".arrow") for path in files) == 3
    assert any(path.endswith("index.sqlite") for path in files)
    assert set(files.values()) == {0o600}, files


# ---- nothing readable at rest ------------------------------------------------------------------------------------


def forbidden_patterns(page):
    """Byte patterns that would give the page's tokens, its page key or its KV away."""
    token_ids = list(page.token_ids)
    kv_bytes = page.kv.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
    return {
        "token ids (msgpack)": msgpack.packb(token_ids[:16]),
        "token ids (int64)": np.asarray(token_ids[:16], dtype=np.int64).tobytes(),
        "token ids (int32)": np.asarray(token_ids[:16], dtype=np.int32).tobytes(),
        "page key": page.key,
        "page key (hex)": page.key.hex().encode(),
        "kv bytes": kv_bytes[4096:4160],
    }


def test_no_token_ids_page_keys_or_kv_at_rest(disk, redis_server):
    disk_tier = disk()
    host_tier = RedisTier(redis_server, disk_tier.page_format, key_prefix="atrest:", tier_key=TierKey(SECRET))
    try:
        pages = chain_pages(disk_tier.page_format, 2, seed=4)
        for tier in (disk_tier, host_tier):
            tier.store(pages)
            assert tier.flush(timeout=10)
        client = redis.Redis.from_url(redis_server)
        stored = [open(path, "rb").read() for path in page_files(disk_tier.page_path(b"x").rsplit("/", 3)[0])]
        stored += [client.get(name) for name in client.keys("atrest:*") if not name.endswith(b"format")]
        stored.append(b"".join(str(name).encode() for name in client.keys("atrest:*")))
        stored.append(" ".join(str(path) for path in page_files(disk_tier.page_path(b"x").rsplit("/", 3)[0])).encode())
        assert len(stored) == 2 + 2 + 2
        for page in pages:
            for what, pattern in forbidden_patterns(page).items():
                assert not any(pattern in blob for blob in stored), what
        assert_bit_identical(host_tier.load(keys_of(pages), tokens_of(pages)), pages)
    finally:
        host_tier.close()


def test_another_clusters_key_sees_nothing_and_its_entries_fail_authentication(disk, redis_server):
    ours = RedisTier(redis_server, make_format(), key_prefix="twokeys:", tier_key=TierKey(SECRET))
    theirs = RedisTier(redis_server, make_format(), key_prefix="twokeys:", tier_key=TierKey(b"another cluster" * 3))
    try:
        pages = chain_pages(ours.page_format, 2, seed=5)
        theirs.store(pages)
        assert theirs.flush(timeout=10)
        assert ours.lookup(keys_of(pages)) == 0  # other names: their pages are invisible to us
        client = redis.Redis.from_url(redis_server)  # plant their entry under our name: a tampered entry
        client.set(ours.redis_key(pages[0].key), client.get(theirs.redis_key(pages[0].key)))
        assert ours.load(keys_of(pages[:1]), tokens_of(pages[:1])) == []
        assert ours.stats().discarded_corrupt == 1
    finally:
        ours.close()
        theirs.close()


def test_key_file_is_created_once_0600_and_must_be_long_enough(tmp_path):
    path = tmp_path / "keys" / "kv-tier.key"
    results = []
    threads = [threading.Thread(target=lambda: results.append(create_key_file(path))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False, False, False, True]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert load_key_file(path).key_id == load_key_file(path).key_id
    short = tmp_path / "short.key"
    short.write_text("too short")
    with pytest.raises(ValueError, match="at least 32"):
        load_key_file(short)
    with pytest.raises(TypeError):
        __import__("pickle").dumps(load_key_file(path))


def test_a_binary_key_file_keeps_every_byte_and_a_text_key_loses_its_newline(tmp_path):
    """Raw random key bytes may begin or end with a whitespace byte: stripping them would shorten (and so refuse or
    change) the key. A text key keeps working with or without the newline ``print`` adds."""
    secret = b"\n" + bytes(range(0x80, 0x9E)) + b" "  # 32 bytes, whitespace at both ends, not text
    binary = tmp_path / "binary.key"
    binary.write_bytes(secret)
    assert load_key_file(binary).key_id == TierKey(secret).key_id
    # text keys, one copy with the final newline and one without, give one key (two nodes' copies of one secret)
    wrapped_base64 = "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo=\nYWJjZGVmZ2hpamtsbW5vcHFyc3R1dnd4eXo="  # `openssl rand -base64`
    for text in ("ab" * 32, wrapped_base64, "ein Geheimnis über dreißig Bytes lang, wirklich"):
        with_newline, without = tmp_path / "a.key", tmp_path / "b.key"
        with_newline.write_text(text + "\n", encoding="utf-8")
        without.write_text(text, encoding="utf-8")
        assert load_key_file(with_newline).key_id == load_key_file(without).key_id == \
            TierKey(text.encode("utf-8")).key_id


# ---- one budget, chain-aware eviction -----------------------------------------------------------------------------


def test_eviction_removes_chain_tails_before_their_parents(disk):
    size = file_size_of(make_format())
    tier = disk(budget_bytes=int(6.5 * size))  # evicts to 0.9 * 6.5 = 5.85 pages' worth
    chain_a = chain_pages(tier.page_format, 4, seed=10)  # a0 (oldest) .. a3
    chain_b = chain_pages(tier.page_format, 2, seed=11)
    tier.store(chain_a)
    tier.flush(timeout=10)
    tier.store(chain_b)
    tier.flush(timeout=10)

    chain_c = chain_pages(tier.page_format, 1, seed=12)
    tier.store(chain_c)  # 7 pages > 6.5: evict to 4 pages (5.85 - 1 for c0): two go
    tier.flush(timeout=10)

    present = {key for key in keys_of(chain_a + chain_b + chain_c) if os.path.exists(tier.page_path(key))}
    # by age alone a0 and a1 would go, leaving a2 and a3 unreachable; tails first takes a3, then a2
    assert present == set(keys_of(chain_a[:2] + chain_b + chain_c))
    assert tier.stats().pages_evicted == 2
    assert set(page_files(os.path.dirname(os.path.dirname(os.path.dirname(tier.page_path(b"x")))))) == {
        tier.page_path(key) for key in present}

    assert len(tier.load(keys_of(chain_a[:2]), tokens_of(chain_a[:2]))) == 2  # a0, a1 now the most recent
    tier.store(chain_pages(tier.page_format, 2, seed=13))  # 5 + 2 > 6.5: evict to 5.85 - 2: two go, b1 then b0
    tier.flush(timeout=10)
    present = {key for key in keys_of(chain_a + chain_b + chain_c) if os.path.exists(tier.page_path(key))}
    assert present == set(keys_of(chain_a[:2] + chain_c))
    assert tier.stats().pages_evicted == 4
    assert tier.total_bytes_estimate == sum(page_files(tier.page_path(b"x").rsplit("/", 3)[0]).values()) == 5 * size


def _write_many(root, first_seed, num_chains, barrier):
    tier = DiskTier(root, make_format(), budget_bytes=_write_many.budget, tier_key=TierKey(SECRET), queue_size=1024)
    barrier.wait()
    for seed in range(first_seed, first_seed + num_chains):
        tier.store(chain_pages(tier.page_format, 2, seed=seed))
    tier.flush(timeout=60)
    tier.close()
    os._exit(0)


def test_two_writer_processes_share_one_budget(tmp_path):
    size = file_size_of(make_format())
    budget = 7 * size + size // 2
    _write_many.budget = budget
    root = str(tmp_path / "kv")
    DiskTier(root, make_format(), budget_bytes=budget, tier_key=TierKey(SECRET)).close()
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    writers = [context.Process(target=_write_many, args=(root, first, 12, barrier)) for first in (100, 200)]
    for writer in writers:
        writer.start()
    sizes_seen = []
    index = sqlite3.connect(os.path.join(root, "index.sqlite"), timeout=30, isolation_level=None)
    while any(writer.is_alive() for writer in writers):
        index.execute("BEGIN IMMEDIATE")  # the writers' lock: a consistent view of the files between two commits
        sizes_seen.append(sum(page_files(root).values()))
        index.execute("ROLLBACK")
        time.sleep(0.005)
    index.close()
    for writer in writers:
        writer.join()

    assert [writer.exitcode for writer in writers] == [0, 0]
    final = page_files(root)
    assert 0 < sum(final.values()) <= budget
    assert max(sizes_seen + [0]) <= budget  # never over, also while both were writing
    check = DiskTier(root, make_format(), budget_bytes=budget, tier_key=TierKey(SECRET))
    try:
        assert check.total_bytes_estimate == sum(final.values())
    finally:
        check.close()


# ---- a redis-server started by us -------------------------------------------------------------------------------


def test_started_redis_requires_its_password_and_listens_on_loopback_only(disk):
    from cluster.cli import start_local_redis

    server = start_local_redis(maxmemory="64mb")
    try:
        assert server.password and server.password not in server.redacted_url
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, socket_timeout=2).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(f"redis://:wrong@127.0.0.1:{server.port}/0", socket_timeout=2).ping()
        client = redis.Redis.from_url(server.url, socket_timeout=2)
        assert client.ping()
        assert client.config_get("bind")["bind"].split()[0] == "127.0.0.1"
        assert server.password not in " ".join(Path(f"/proc/{server.process.pid}/cmdline").read_text().split("\0"))

        tier = RedisTier(server.url, make_format(), tier_key=TierKey(SECRET))
        no_password = RedisTier(f"redis://127.0.0.1:{server.port}/0", make_format(), tier_key=TierKey(SECRET))
        try:
            pages = chain_pages(tier.page_format, 2, seed=20)
            tier.store(pages)
            assert tier.flush(timeout=10)
            assert_bit_identical(tier.load(keys_of(pages), tokens_of(pages)), pages)
            assert no_password.lookup(keys_of(pages)) == 0 and not no_password.available
            assert no_password.stats().errors >= 1
        finally:
            tier.close()
            no_password.close()
    finally:
        server.stop()


def process_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie waiting for init to reap it is dead


def test_redis_server_dies_when_its_parent_is_sigkilled():
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import time; from cluster.cli import start_local_redis; server = start_local_redis(maxmemory='32mb'); "
         "print(server.process.pid, flush=True); time.sleep(120)"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True,
    )
    try:
        redis_pid = int(parent.stdout.readline())
        assert not process_gone(redis_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not process_gone(redis_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_gone(redis_pid), "redis-server outlived its SIGKILLed parent"
    finally:
        parent.kill()


def test_a_tier_that_hangs_costs_the_request_its_timeout_not_more(tmp_path):
    """A tier call that does not come back (a hung NFS mount, a stuck socket) is abandoned after tier_timeout_s."""
    import asyncio

    from replica.kv_sources import PrefixFetcher

    class HangingDiskTier(DiskTier):
        def lookup(self, keys):
            time.sleep(3)
            return len(keys)

        def load(self, keys, token_ids_per_page):  # what the fetcher calls (it skips lookup)
            time.sleep(3)
            return []

    tier = HangingDiskTier(tmp_path / "kv", make_format(), budget_bytes=1 << 30, tier_key=TierKey(SECRET))
    try:
        pages = chain_pages(tier.page_format, 2, seed=30)
        fetcher = PrefixFetcher(tier.page_format, tiers=[tier], tier_timeout_s=0.3)
        async def timed_fetch():
            started = time.monotonic()
            fetched = await fetcher.fetch(keys_of(pages), tokens_of(pages))
            return fetched, time.monotonic() - started  # (asyncio.run then waits for the abandoned thread)

        fetched, elapsed = asyncio.run(timed_fetch())
        assert fetched == [] and elapsed < 2
        assert fetcher.source_to_stats[tier.source].errors == 1
    finally:
        tier.close()


def write_tls_files(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it (PEM files): ca.pem, server.pem, server.key."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "prefixserve test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(2)
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def test_redis_url_with_tls_and_a_password_works(tmp_path):
    from conftest import REDIS_SERVER_BINARY, find_free_port

    if REDIS_SERVER_BINARY is None:
        pytest.skip("redis-server is not installed")
    ca, cert, key = write_tls_files(tmp_path)

    def start_tls_redis(port: int) -> subprocess.Popen:
        server = subprocess.Popen(
            [REDIS_SERVER_BINARY, "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server.stdin.write((
            f"port 0\ntls-port {port}\nbind 127.0.0.1\ntls-cert-file {cert}\ntls-key-file {key}\n"
            f"tls-ca-cert-file {ca}\ntls-auth-clients no\nrequirepass tls-test-pw\nsave \"\"\nappendonly no\n"
        ).encode())
        server.stdin.close()
        return server

    # a port found free can be taken by another process before redis-server binds it: redis-server then exits, and
    # starts again on a fresh port
    for attempt in range(1, 5):
        port = find_free_port()
        server = start_tls_redis(port)
        url = f"rediss://:tls-test-pw@127.0.0.1:{port}/0?ssl_ca_certs={ca}"
        deadline = time.monotonic() + 10
        while server.poll() is None:
            try:
                redis.Redis.from_url(url, socket_timeout=1).ping()
                break
            except (redis.ConnectionError, redis.TimeoutError):  # not up yet, or another process on the port
                if time.monotonic() > deadline:
                    server.terminate()
                    server.wait(timeout=10)
                    raise AssertionError("TLS redis-server did not start") from None
                time.sleep(0.1)
        if server.poll() is None:
            break
        assert attempt < 4, f"TLS redis-server exited with {server.returncode}"
    try:
        tier = RedisTier(url, make_format(), tier_key=TierKey(SECRET))
        plain = RedisTier(f"redis://:tls-test-pw@127.0.0.1:{port}/0", make_format(), tier_key=TierKey(SECRET))
        try:
            pages = chain_pages(tier.page_format, 2, seed=40)
            tier.store(pages)
            assert tier.flush(timeout=10)
            assert_bit_identical(tier.load(keys_of(pages), tokens_of(pages)), pages)
            assert tier.stats().errors == 0
            assert plain.lookup(keys_of(pages)) == 0 and not plain.available  # no TLS: no answer
        finally:
            tier.close()
            plain.close()
    finally:
        server.terminate()
        server.wait(timeout=10)
