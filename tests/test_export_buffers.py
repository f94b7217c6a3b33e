"""Reused memory for host bundles' copies (replica/export_buffers.py): a buffer goes out again only once nothing holds
its memory (a page's view, the bundle's numpy array), so an export never overwrites KV that a bundle still carries."""

from __future__ import annotations

import copy
import gc

import numpy as np
import pytest
import torch

from engine_utils import TinyModel, greedy, random_prompt
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.export_buffers import ROUND_BYTES, ExportBuffers
from replica.page_record import PageRecord
from replica.peer_copy import bundle_pages, unbundle_pages
from common.types import EngineRequest


def test_a_buffer_goes_out_again_only_when_nothing_holds_it():
    buffers = ExportBuffers()
    first = buffers.take((3, 4, 5), torch.float32)
    assert first.shape == (3, 4, 5) and first.dtype == torch.float32 and first.is_contiguous()
    address = first.data_ptr()
    second = buffers.take((3, 4, 5), torch.float32)  # the first is held: new memory
    assert second.data_ptr() != address and buffers.allocated == 2
    row = first[1]
    del first
    third = buffers.take((2, 4, 5), torch.bfloat16)  # a view of the first is held; the second too
    assert third.data_ptr() not in (address, second.data_ptr())
    del row, third
    gc.collect()
    fourth = buffers.take((2, 4, 5), torch.bfloat16)  # the first (least recently taken, smallest that fits) again
    assert fourth.data_ptr() == address and buffers.reused == 1
    assert fourth.dtype == torch.bfloat16 and fourth.shape == (2, 4, 5)


def test_a_numpy_array_over_a_buffer_keeps_it_out_of_reuse():
    buffers = ExportBuffers()
    taken = buffers.take((4, 8), torch.bfloat16)
    array = taken.view(torch.uint16).numpy()
    address = array.ctypes.data
    del taken
    gc.collect()
    assert buffers.take((4, 8), torch.bfloat16).data_ptr() != address
    del array
    gc.collect()
    assert buffers.take((4, 8), torch.bfloat16).data_ptr() == address


def test_retained_memory_is_bounded():
    buffers = ExportBuffers(max_retained_bytes=2 * ROUND_BYTES)
    big = buffers.take((3 * ROUND_BYTES // 4,), torch.float32)  # 3 steps, over the bound: handed out, not kept
    assert buffers.retained_bytes() == 0
    del big
    held = [buffers.take((ROUND_BYTES // 4,), torch.float32) for _ in range(3)]  # the third would pass the bound
    assert buffers.retained_bytes() == 2 * ROUND_BYTES and buffers.allocated == 4
    del held
    gc.collect()
    buffers.take((ROUND_BYTES // 4,), torch.float32)
    assert buffers.reused == 1
    buffers.take((2 * ROUND_BYTES // 4,), torch.float32)  # a larger size: the free ones make room for it
    assert buffers.retained_bytes() == 2 * ROUND_BYTES and buffers.allocated == 5
    buffers.take((2 * ROUND_BYTES // 4,), torch.float32)
    assert buffers.reused == 2


def test_a_buffer_behind_others_is_reused_and_tensors_are_never_compared():
    """The list is searched by identity: a free buffer behind a smaller one, or behind a held one of its size, is
    handed out (comparing tensors with ``==`` would raise on either)."""
    buffers = ExportBuffers()
    small = buffers.take((16,), torch.float32)
    del small
    large = buffers.take((3 * ROUND_BYTES // 4,), torch.float32)
    address = large.data_ptr()
    del large
    assert buffers.take((3 * ROUND_BYTES // 4,), torch.float32).data_ptr() == address  # behind the smaller one
    first = buffers.take((ROUND_BYTES // 4,), torch.float32)  # the small one
    second = buffers.take((ROUND_BYTES // 4,), torch.float32)  # the large one, the only free one that fits
    third = buffers.take((ROUND_BYTES // 4,), torch.float32)  # new
    address = third.data_ptr()
    del third
    assert buffers.take((ROUND_BYTES // 4,), torch.float32).data_ptr() == address  # behind two held ones
    assert first.data_ptr() != second.data_ptr() and buffers.reused == 4


def test_a_bundle_over_a_reused_buffer_is_zero_copy_and_survives_the_next_export():
    """The leading slots of a larger buffer travel as they are (no stacking copy); the next export, while that bundle
    is held, gets other memory, so the bundle's bits stay what was exported."""
    buffers = ExportBuffers()
    stacked = buffers.take((3, 2, 4), torch.float32)
    stacked.copy_(torch.randn(3, 2, 4))
    want = stacked.clone()
    pages = [PageRecord(bytes([index + 1]) * 32, (index,), stacked[index]) for index in range(3)]
    bundle = bundle_pages(pages)
    assert bundle.kv.ctypes.data == stacked.data_ptr()
    del pages, stacked
    gc.collect()
    other = buffers.take((3, 2, 4), torch.float32)
    other.fill_(7.0)
    got = unbundle_pages(bundle)
    assert all(torch.equal(page.kv, want[index]) for index, page in enumerate(got))


@pytest.fixture(scope="module")
def tiny():
    return TinyModel("llama", seed=5)


def test_the_engine_exports_host_bundles_into_reused_memory_bit_exact(tiny):
    engine = LLMEngine(EngineConfig(num_pages=32, replica_id="A"), copy.deepcopy(tiny.served))
    prompt = random_prompt(3 * engine.config.page_size + 5, seed=3)
    engine.add_request(EngineRequest("h", prompt, greedy(1)))
    while engine.has_work():
        engine.step()
    keys = engine.page_keys(prompt)[:3]
    want = [engine.runner.read_page(page_id).clone() for page_id in engine.kv.match_prefix(keys)]

    first = engine.export_pages(keys, contiguous=True)
    held = bundle_pages(first)
    address = held.kv.ctypes.data
    second = engine.export_pages_concurrently(keys, contiguous=True)
    assert bundle_pages(second).kv.ctypes.data != address  # the first bundle is held
    del first, held, second
    gc.collect()
    third = engine.export_pages_concurrently(keys, contiguous=True)
    assert engine.export_buffers.reused >= 1
    bundle = bundle_pages(third)
    assert bundle.kv.ctypes.data == third[0].kv.data_ptr()  # zero copy over the reused buffer
    assert all(torch.equal(page.kv, kv) for page, kv in zip(unbundle_pages(bundle), want))
    assert isinstance(bundle.kv, np.ndarray)


def test_without_torchs_use_count_no_buffer_is_reused(monkeypatch):
    """If torch stops exposing the storage use count, every export gets memory of its own (the old behaviour)."""
    import replica.export_buffers as export_buffers

    monkeypatch.setattr(export_buffers, "_storage_use_count", None)
    buffers = ExportBuffers()
    first = buffers.take((4, 8), torch.float32)
    del first
    gc.collect()
    second = buffers.take((4, 8), torch.float32)
    assert second.shape == (4, 8) and second.dtype == torch.float32
    assert buffers.reused == 0 and buffers.retained_bytes() == 0 and buffers.allocated == 2  # nothing kept
