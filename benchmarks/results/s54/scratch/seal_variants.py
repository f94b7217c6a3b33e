"""One thread opening 16 sealed 1 MiB pages into a KV pool's runs (16 per page), three ways: the tier's streamed
AES-256-GCM (``TierKey.open_into`` with a list), one-shot into a 1 MiB scratch buffer and then copied run by run, and
streamed into a 64 KiB chunk then copied. Medians of 11 rounds; each variant's result is checked against the plaintext.
PYTHONPATH=. .venv/bin/python benchmarks/results/s54/scratch/seal_variants.py"""
import os, time, statistics
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from replica.tiers.seal import TierKey, new_nonce, TAG_BYTES
key = TierKey.generate()
plain = bytearray(os.urandom(1 << 20)); ad = b"x" * 32
sealed = [bytearray((1 << 20) + 16) for _ in range(16)]
nonces = [new_nonce() for _ in range(16)]
for i in range(16): key.seal_into(nonces[i], plain, ad, sealed[i])
pool = torch.zeros(16, 64, 16, 1 << 16, dtype=torch.uint8)
scratch = bytearray(1 << 20); sv = memoryview(scratch)
chunk = bytearray(1 << 16); cv = memoryview(chunk)
def runs(i): return [memoryview(pool[p, i, 0].numpy()).cast("B") for p in range(16)]
def a_stream(i):
    key.open_into(nonces[i], sealed[i], ad, runs(i))
def b_staged(i):
    key._aead.decrypt_into(nonces[i], sealed[i], ad, sv)
    off = 0
    for part in runs(i):
        n = len(part); part[:] = sv[off:off + n]; off += n
def c_chunked(i):
    s = memoryview(sealed[i])
    dec = Cipher(algorithms.AES(key._aead_key), modes.GCM(nonces[i], bytes(s[-TAG_BYTES:]))).decryptor()
    dec.authenticate_additional_data(ad)
    off = 0
    for part in runs(i):
        n = len(part)
        dec.update_into(s[off:off + n], chunk)
        part[:] = cv[:n]; off += n
    dec.finalize()
res = {f: [] for f in (a_stream, b_staged, c_chunked)}
for rep in range(12):
    for f in res:
        t = time.perf_counter()
        for i in range(16): f(i)
        res[f].append(time.perf_counter() - t)
for f, v in res.items(): print(f.__name__, f"{statistics.median(v[1:])*1e3:.2f} ms  min {min(v)*1e3:.2f}")
# check equality
for f in res:
    pool.zero_(); f(3); assert bytes(pool[:, 3, 0].contiguous().numpy().tobytes()) == bytes(plain), f.__name__
print("equal")
