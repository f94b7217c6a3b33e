"""Landing pages (replica/landing.py): a shared-tier load decrypts straight into pool pages reserved for it. The
pieces without an engine: writing a sealed page into a page of the pool, and when a fetch's pages may go back."""

import threading

import pytest
import torch

from replica.landing import LandingPages, writable_bytes
from replica.tiers.codec import RejectedEntry, decode_blob, encode_blob
from replica.tiers.seal import SealError, TierKey, new_nonce
from test_tiers import make_format, make_pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_pool_page_is_written_in_its_runs_and_nothing_around_it_changes(dtype):
    pool = torch.zeros(3, 2, 5, 4, 2, 8, dtype=dtype)
    page = pool[:, :, 3]
    parts = writable_bytes(page)
    assert len(parts) == 6 and all(len(part) == 4 * 2 * 8 * pool.element_size() for part in parts)
    source = torch.randn(3, 2, 4, 2, 8).to(dtype)
    key, nonce = TierKey.generate(), new_nonce()
    plain = source.view(-1).view(torch.uint8).numpy().tobytes()
    sealed = bytearray(len(plain) + 16)
    key.seal_into(nonce, plain, b"header", sealed)

    key.open_into(nonce, sealed, b"header", parts)

    assert torch.equal(pool[:, :, 3], source)
    assert not pool[:, :, [0, 1, 2, 4]].any()
    sealed[3] ^= 1  # a flipped bit fails the tag, as in one piece
    with pytest.raises(SealError):
        key.open_into(nonce, sealed, b"header", writable_bytes(pool[:, :, 1]))
    with pytest.raises(SealError, match="malformed"):
        key.open_into(nonce, sealed[:-1], b"header", writable_bytes(pool[:, :, 1]))


def test_layouts_other_than_runs_of_whole_rows_are_refused():
    contiguous = torch.zeros(2, 3)
    assert len(writable_bytes(contiguous)) == 24  # one buffer
    with pytest.raises(ValueError, match="innermost"):
        writable_bytes(torch.zeros(4, 6)[:, ::2])
    squeezed = torch.zeros(2, 1, 5, 3)[:, :, 1:4]  # a size-1 dimension between runs: still runs of 3 x 3
    assert [len(part) for part in writable_bytes(squeezed)] == [36, 36]


def test_a_blob_decodes_into_a_pool_page_and_a_rejected_one_is_reported():
    page_format = make_format("float32")
    page = make_pages(page_format, 1)[0]
    key = TierKey.generate()
    blob = encode_blob(page, key)
    num_layers, _, page_size, heads, head_dim = page_format.kv_shape
    pool = torch.zeros(num_layers, 2, 3, page_size, heads, head_dim)
    kv = decode_blob(blob, page_format, key, page.key, page.token_ids, pool[:, :, 1])
    assert kv.data_ptr() == pool[:, :, 1].data_ptr()
    assert torch.equal(pool[:, :, 1].view(torch.int32), page.kv.view(torch.int32))
    blob[-20] ^= 1
    with pytest.raises(RejectedEntry):
        decode_blob(blob, page_format, key, page.key, page.token_ids, pool[:, :, 2])
    with pytest.raises(ValueError, match="shape"):
        decode_blob(encode_blob(page, key), page_format, key, page.key, page.token_ids, pool[:1, :, 2])


class Releases:
    def __init__(self):
        self.calls = []

    def __call__(self, landing):
        self.calls.append(list(landing.page_ids))


def test_pages_go_back_once_the_fetch_drops_them_and_no_load_writes_into_them():
    releases = Releases()
    landing = LandingPages([4, 6], [torch.zeros(1), torch.zeros(1)], releases)
    assert landing.begin_load() and landing.begin_load()
    landing.drop()  # the fetch is done with them, but two loads still run (one timed out, say)
    assert releases.calls == [] and not landing.released
    landing.end_load()
    assert releases.calls == []
    landing.end_load()
    assert releases.calls == [[4, 6]] and landing.released
    landing.drop()  # idempotent
    assert releases.calls == [[4, 6]]
    assert landing.begin_load() is False  # gone back: a later load uses tensors of its own
    timed_out = LandingPages([7], [torch.zeros(1)], releases)
    timed_out.writable = False
    assert timed_out.begin_load() is False

    idle = LandingPages([1], [torch.zeros(1)], releases)
    idle.drop()
    assert releases.calls[-1] == [1]
    loaded = LandingPages([2], [torch.zeros(1)], releases)
    loaded.begin_load()
    loaded.end_load()  # a load that ends before the drop releases nothing
    assert releases.calls[-1] == [1]
    loaded.drop()
    assert releases.calls[-1] == [2]


def test_a_drop_racing_the_last_load_releases_exactly_once():
    for _ in range(200):
        releases = Releases()
        landing = LandingPages([3], [torch.zeros(1)], releases)
        landing.begin_load()
        threads = [threading.Thread(target=landing.end_load), threading.Thread(target=landing.drop)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert releases.calls == [[3]]
