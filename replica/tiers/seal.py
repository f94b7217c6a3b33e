"""The cluster key that keeps shared-tier data private: what a stored page is named, how its tokens are checked, and
how its KV is sealed.

Everything a tier stores is derived from one secret (the cluster key, ``--kv-tier-key-file``) with keyed BLAKE2b:

    storage id   = BLAKE2b(page key,  key=K_name)   the Redis key / file name: no unkeyed page hash is stored, so a
                                                     reader of the store cannot confirm a guessed prompt
    token digest = BLAKE2b(token ids, key=K_tokens) stored instead of the token ids; reuse still compares it with the
                                                     request's (a stale entry or a hash collision is a miss)
    payload      = AES-256-GCM(K_aead, random 96-bit nonce, KV bytes, associated data = header + page key)
                                                     the KV is encrypted (layer-0 K/V would give the tokens back) and
                                                     the header, the page key and the KV are authenticated together:
                                                     a flipped bit, a swapped or foreign entry fails the tag

A store shared by holders of other keys is harmless: their entries have other names, and a planted one fails the tag.
Random nonces: one key may seal about 2^32 pages before the nonce-collision bound matters (years at the write rates of
BENCHMARKS.md); rotate the key file (a new key simply misses the old entries, which age out) well before that.

Key file: at least 32 bytes of secret (``secrets.token_hex(32)`` is what ``create_key_file`` writes), mode 0600.
Without ``--kv-tier-key-file`` every process on one machine uses ``<prefixserve cache dir>/kv-tier.key``, created on
first use; replicas on other machines sharing a Redis need the same file (give it with ``--kv-tier-key-file``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import stat
import unicodedata
from pathlib import Path
from typing import Sequence

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

logger = logging.getLogger(__name__)

KEY_FILE_NAME = "kv-tier.key"
MIN_SECRET_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
KEY_ID_BYTES = 8


class SealError(Exception):
    """A sealed payload failed authentication (tampered, truncated, or sealed under another key)."""


class TierKey:
    """The cluster key, expanded into the three subkeys a tier uses. Holds secrets: never log or pickle it."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a KV tier key needs at least {MIN_SECRET_BYTES} bytes of secret, got {len(secret)}")
        master = hashlib.blake2b(secret, digest_size=64, person=b"psx-tier-master").digest()
        self._name_key = _subkey(master, b"storage-id")
        self._token_key = _subkey(master, b"token-digest")
        self._aead_key = _subkey(master, b"aes-gcm")
        self._aead = AESGCM(self._aead_key)
        self.key_id = _subkey(master, b"key-id")[:KEY_ID_BYTES]
        """Public fingerprint of the key (in every header): says "sealed under another key" in a log line."""

    @classmethod
    def generate(cls) -> "TierKey":
        """A fresh random key (a tier built without one: private to this process)."""
        return cls(secrets.token_bytes(MIN_SECRET_BYTES))

    def __repr__(self) -> str:
        return f"TierKey(id={self.key_id.hex()})"

    def __reduce__(self):
        raise TypeError("a TierKey is a secret and is not pickled; pass the key file's path instead")

    def storage_id(self, page_key: bytes) -> str:
        """The name a page is stored under (hex, 40 characters)."""
        return hashlib.blake2b(page_key, key=self._name_key, digest_size=20).hexdigest()

    def token_digest(self, token_ids: Sequence[int]) -> bytes:
        """Keyed digest of a page's token ids (what is stored and compared instead of the ids)."""
        packed = np.asarray(token_ids, dtype=np.int64).tobytes()
        return hashlib.blake2b(packed, key=self._token_key, digest_size=32).digest()

    def seal_into(self, nonce: bytes, plaintext, associated_data: bytes, out) -> None:
        """Encrypt ``plaintext`` into ``out`` (a writable buffer of ``len(plaintext) + TAG_BYTES`` bytes)."""
        self._aead.encrypt_into(nonce, plaintext, associated_data, out)

    def open_into(self, nonce: bytes, sealed, associated_data: bytes, out) -> None:
        """Decrypt and authenticate ``sealed`` into ``out`` (``len(sealed) - TAG_BYTES`` bytes), or into a list of
        buffers filled in order (the runs of a page in the KV pool, whose layers lie apart); SealError if the tag
        fails (``out`` then holds garbage the caller must not use)."""
        try:
            if isinstance(out, list):
                self._open_into_parts(nonce, sealed, associated_data, out)
            else:
                self._aead.decrypt_into(nonce, sealed, associated_data, out)
        except InvalidTag:
            raise SealError("authentication tag mismatch: tampered, truncated or sealed under another key") from None
        except ValueError as exc:  # wrong lengths
            raise SealError(f"malformed sealed payload: {exc}") from None


    def _open_into_parts(self, nonce: bytes, sealed, associated_data: bytes, parts: list) -> None:
        """``open_into`` for a list of buffers: the same AES-256-GCM, streamed (within ~10% of the one-shot call on one
        core here, 2.3 against 2.5 GB/s), with the tag checked once every part is written."""
        sealed = memoryview(sealed).cast("B")
        if len(sealed) < TAG_BYTES or sum(len(part) for part in parts) != len(sealed) - TAG_BYTES:
            raise ValueError(f"{len(sealed)} sealed bytes do not fill the {len(parts)} parts given")
        decryptor = Cipher(algorithms.AES(self._aead_key), modes.GCM(nonce, bytes(sealed[-TAG_BYTES:]))).decryptor()
        decryptor.authenticate_additional_data(associated_data)
        offset = 0
        for part in parts:
            size = len(part)
            decryptor.update_into(sealed[offset : offset + size], part)
            offset += size
        decryptor.finalize()


def _subkey(master: bytes, label: bytes) -> bytes:
    return hashlib.blake2b(label, key=master, digest_size=32, person=b"psx-tier-subkey").digest()


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def default_key_path() -> Path:
    from replica.config import default_cache_dir

    return default_cache_dir() / KEY_FILE_NAME


def create_key_file(path: str | os.PathLike) -> bool:
    """Write a new random key to ``path`` (mode 0600, folder created 0700) unless a file is there; True if created.
    Safe against concurrent callers: exactly one creates it, the others read the same key."""
    path = Path(path).expanduser()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(MIN_SECRET_BYTES) + "\n")
        os.link(temp, path)  # atomic create-if-absent: readers never see a partial key
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(temp)


def _key_file_secret(raw: bytes) -> bytes:
    """The key in a key file's bytes. A text key (UTF-8 without control characters other than whitespace: hex,
    base64 wrapped over lines, a passphrase) loses the whitespace around it, such as the newline that ``print``, an
    editor or a secret store may or may not add, as every version before binary keys did. Binary key bytes (``head -c
    32 /dev/urandom``) are the key as they are, so a random key that happens to begin or end with a whitespace byte
    keeps all of its bytes."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw
    if any(unicodedata.category(char) == "Cc" and char not in "\t\n\v\f\r" for char in text):
        return raw
    return raw.strip()


def load_key_file(path: str | os.PathLike) -> TierKey:
    """The key in ``path``. Raises ValueError (with the remedy) if it is missing, too short, or not a regular file;
    warns if other users may read it."""
    path = Path(path).expanduser()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"cannot read the KV tier key file {path}: {exc.strerror}; create one with "
                         f"`python -c 'import secrets; print(secrets.token_hex(32))' > {path}; chmod 600 {path}`") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"the KV tier key file {path} is not a regular file")
        if info.st_mode & 0o077:
            logger.warning("KV tier key file %s is readable by other users (mode %o); chmod 600 it",
                           path, stat.S_IMODE(info.st_mode))
        secret = _key_file_secret(file.read(4096))
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the KV tier key file {path} holds {len(secret)} bytes; it needs at least "
                         f"{MIN_SECRET_BYTES} (e.g. the output of `python -c 'import secrets; "
                         "print(secrets.token_hex(32))'`)")
    return TierKey(secret)


def resolve_key(key_file: str | os.PathLike | None) -> TierKey:
    """The key of ``key_file``, or of the default per-machine key file (created on first use) when None."""
    if key_file is not None:
        return load_key_file(key_file)
    path = default_key_path()
    if create_key_file(path):
        logger.info("created the KV tier key %s (give it to every node with --kv-tier-key-file)", path)
    return load_key_file(path)
