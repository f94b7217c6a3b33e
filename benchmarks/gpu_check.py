"""GPU checks of the replica engine (run on a CUDA machine; no Ray needed):

1. Greedy tokens of the paged engine on CUDA equal transformers' generate on the same weights (float32) for Llama,
   Qwen2 and Mistral tiny models: cold, exact repeat, shared prefix + new suffix, a mixed batch, preemption; with
   decode steps as CUDA graphs (the default) and with ``enforce_eager``.
2. Device-to-device peer copy between two engines on one GPU: pages exported on the device and written into the
   other engine's pool are bit-identical, and the reader's output equals the reference; time of the copy vs recompute.
3. GPU TTFT of a 2048-token prefix + 64-token suffix (bf16, hidden 512 x 8 layers): cold, warm, suffix alone.
4. (when Ray is importable) Peer copy between two replica processes: two Ray actors share the GPU (num_gpus=0.5), each
   a ``ServeReplica`` loaded from a model folder; the receiver's ``ServePeerClient`` calls the holder's
   ``export_pages`` / ``release_pages`` over the actor handle, and gets a CUDA IPC bundle (device to device). Checked:
   greedy tokens equal transformers, pages bit-identical, transport counted, lease released. Timed: obtaining a
   2048-token prefix (bf16, hidden 512 x 8 layers) by CUDA IPC vs through host memory vs the holder computing it.

    python benchmarks/gpu_check.py            # prints PASS/FAIL lines and timing tables; exit 1 on any failure
"""

from __future__ import annotations

import asyncio
import copy
import os
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from replica.async_engine import AsyncEngine
from replica.config import EngineConfig
from replica.engine import LLMEngine
from replica.kv_sources import PrefixFetcher, page_format_of
from replica.model_runner import CUDA_COMPILE_ENV, env_flag
from common.types import EngineRequest
from common.types import SamplingParams
from benchmarks.gpu_decode import timed_request


DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")  # "cpu" for a dry run of the script itself
FAILURES: list[str] = []


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def tiny_config(arch: str):
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=2048)
    if arch == "llama":
        return LlamaConfig(num_key_value_heads=2, **common)
    if arch == "qwen2":
        return Qwen2Config(num_key_value_heads=1, **common)
    return MistralConfig(num_key_value_heads=2, sliding_window=200, **common)


def models(config, dtype=torch.float32):
    torch.manual_seed(0)
    served = AutoModelForCausalLM.from_config(copy.deepcopy(config)).to(DEVICE, dtype).eval()
    ref_config = copy.deepcopy(config)
    ref_config._attn_implementation = "eager"
    reference = AutoModelForCausalLM.from_config(ref_config, attn_implementation="eager").to(DEVICE, dtype).eval()
    reference.load_state_dict(served.state_dict())
    reference.generation_config.eos_token_id = None
    return served, reference


def prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@torch.inference_mode()
def generate(reference, tokens, n):
    out = reference.generate(torch.tensor([tokens], device=DEVICE), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(tokens):].tolist()


def run(engine, prompts: dict, n: int):
    for rid, p in prompts.items():
        engine.add_request(EngineRequest(rid, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)))
    tokens = {rid: [] for rid in prompts}
    cached = {}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                cached[out.request_id] = out.cached_tokens
        engine.check_integrity()
    return tokens, cached


def check_equivalence(arch: str, enforce_eager: bool = False) -> None:
    """Default: the compiled forward, its decode steps replayed as CUDA graphs (replica/cuda_graphs.py; with
    ``PREFIXSERVE_CUDA_COMPILE=0`` the eager forward's); ``enforce_eager``: neither."""
    served, reference = models(tiny_config(arch))
    compiled = env_flag(CUDA_COMPILE_ENV, True)  # the runner's own rule
    mode = "eager" if enforce_eager else ("compiled" if compiled else "graphs")
    engine = LLMEngine(EngineConfig(devices="gpu", num_pages=64, max_num_batched_tokens=300,
                                    enforce_eager=enforce_eager), served, device=DEVICE)
    prefix = prompt(300, 1)
    cases = {"cold": prefix + prompt(20, 2)}
    tokens, _ = run(engine, cases, 6)
    cases2 = {"repeat": cases["cold"], "suffix": prefix + prompt(45, 3), "short": prompt(7, 4),
              "long": prompt(700, 5)}
    tokens2, cached = run(engine, cases2, 6)
    tokens.update(tokens2)
    ok = all(tokens[rid] == generate(reference, p, 6) for rid, p in {**cases, **cases2}.items())
    graphs = engine.runner.decode_graphs
    replays = graphs.replays if graphs is not None else 0
    graphs_ok = (graphs is None) if enforce_eager or DEVICE != "cuda" else (graphs.captured and replays > 0)
    if mode == "compiled" and DEVICE == "cuda":  # one graph for every step shape (replica/compile.py)
        graphs_ok = graphs_ok and engine.runner.backend == "compiled" and engine.runner.num_compiles == 1
    check(f"greedy equality on CUDA float32 ({arch}, {mode})", ok and cached["repeat"].local == 256 and graphs_ok,
          f"cached repeat={cached['repeat'].local} graph replays={replays}")
    small = LLMEngine(EngineConfig(devices="gpu", num_pages=8, max_model_len=1024, enforce_eager=enforce_eager),
                      served, device=DEVICE)
    prompts = {f"p{i}": prompt(250 + i, 10 + i) for i in range(6)}
    tokens, _ = run(small, prompts, 12)
    ok = all(tokens[rid] == generate(reference, p, 12) for rid, p in prompts.items())
    stats = small.stats()
    check(f"preemption + eviction on CUDA ({arch}, {mode})", ok and stats.num_preemptions > 0,
          f"preemptions={stats.num_preemptions} evictions={stats.num_evictions}")


class DevicePeer:
    """Peer copy inside one process on one GPU: export on the device, write device to device."""

    def __init__(self, holder: AsyncEngine) -> None:
        self.holder = holder
        self.seconds = 0.0

    async def fetch(self, peer_id, keys):
        started = time.perf_counter()
        pages = await self.holder._call(lambda: self.holder.engine.export_pages(list(keys), to_cpu=False))
        sync()
        self.seconds += time.perf_counter() - started
        return pages


def check_device_peer_copy() -> None:
    served, reference = models(tiny_config("llama"))
    holder_engine = LLMEngine(EngineConfig(devices="gpu", num_pages=32, replica_id="A"), served, device=DEVICE)
    holder = AsyncEngine(holder_engine)
    reader_engine = LLMEngine(EngineConfig(devices="gpu", num_pages=32, replica_id="B"), copy.deepcopy(served),
                              device=DEVICE)
    peer = DevicePeer(holder)
    reader = AsyncEngine(reader_engine, PrefixFetcher(page_format_of(reader_engine), peer_client=peer,
                                                       own_replica_id="B"))
    prefix = prompt(3 * 128 + 10, 20)
    first, second = prefix + prompt(20, 21), prefix + prompt(30, 22)

    async def ask(engine, p, rid, hint=None):
        toks, last = [], None
        async for out in engine.generate(EngineRequest(rid, p, SamplingParams(max_tokens=6, temperature=0.0,
                                                                              ignore_eos=True), peer_hint=hint)):
            toks.extend(out.new_token_ids)
            last = out
        return toks, last.cached_tokens

    async def scenario():
        await ask(holder, first, "a")
        return await ask(reader, second, "b", hint="A")

    try:
        tokens, cached = asyncio.run(scenario())
        keys = holder_engine.page_keys(second)[:3]
        same = all(torch.equal(holder_engine.runner.read_page(holder_engine.kv.cache.lookup(k)),
                               reader_engine.runner.read_page(reader_engine.kv.cache.lookup(k))) for k in keys)
        check("device-to-device peer copy: pages bit-identical, output equals reference",
              same and cached.peer == 384 and tokens == generate(reference, second, 6),
              f"cached={cached.as_dict()} kv on {reader_engine.runner.kv_cache.device}")
    finally:
        holder.shutdown()
        reader.shutdown()


def timing_table() -> None:
    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(DEVICE, torch.bfloat16).eval()
    engine = LLMEngine(EngineConfig(devices="gpu", dtype="bfloat16", num_pages=256, max_num_batched_tokens=4096,
                                    max_model_len=4096), model, device=DEVICE)

    def ttft(p, rid):
        return timed_request(engine, p, rid, sync)

    for i in range(3):
        ttft(prompt(2112, 900 + i, 8192), f"warmup{i}")
    cold, warm, floor, copy_s = [], [], [], []
    for r in range(5):
        prefix = prompt(2048, 100 + r, 8192)
        cold.append(ttft(prefix + prompt(64, 200 + r, 8192), f"c{r}"))
        warm.append(ttft(prefix + prompt(64, 300 + r, 8192), f"w{r}"))
        floor.append(ttft(prompt(64, 400 + r, 8192), f"f{r}"))
        keys = engine.page_keys(prefix)
        sync()
        start = time.perf_counter()
        pages = engine.export_pages(keys, to_cpu=False)
        for offset, record in enumerate(pages):
            engine.runner.write_page(200 + offset, record.kv)
        sync()
        copy_s.append(time.perf_counter() - start)
    med = statistics.median
    print("\n| GPU (H200), 2048-token prefix + 64 suffix, bf16, hidden 512 x 8 | median |")
    print("|---|---|")
    print(f"| TTFT cold | {med(cold) * 1000:.2f} ms |")
    print(f"| TTFT warm (prefix cached) | {med(warm) * 1000:.2f} ms |")
    print(f"| TTFT suffix alone (floor) | {med(floor) * 1000:.2f} ms |")
    print(f"| device-to-device copy of the 16 prefix pages (export + write) | {med(copy_s) * 1000:.2f} ms |")
    print(f"| warm / floor | {med(warm) / med(floor):.2f}x |")


class RayReplica:
    """A ServeReplica in a Ray actor; with ``holder`` (an actor handle) its peer client reaches that actor."""

    def __init__(self, model_dir: str, replica_id: str, dtype: str, holder=None, max_model_len: int = 2048) -> None:
        from replica.peer_copy import ServePeerClient
        from replica.serve_replica import ServeReplica

        self.client = None
        if holder is not None:
            self.client = ServePeerClient("ray", "ray", timeout_s=120, device=DEVICE, handle=holder)
        config = EngineConfig(model=model_dir, devices="gpu" if DEVICE == "cuda" else "cpu", dtype=dtype, num_pages=64, max_num_batched_tokens=4096,
                              max_model_len=max_model_len, replica_id=replica_id)
        self.replica = ServeReplica(config, "m", peer_client=self.client)

    def where(self) -> tuple:
        uuid = str(torch.cuda.get_device_properties(0).uuid) if DEVICE == "cuda" else None
        return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES"), uuid

    async def ask(self, tokens: list[int], request_id: str, hint: str | None = None, max_tokens: int = 6):
        out, last = [], None
        started = time.perf_counter()
        async for output in self.replica.generate(EngineRequest(
                request_id, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                peer_hint=hint)):
            out.extend(output.new_token_ids)
            last = output
        return out, last.cached_tokens.as_dict(), time.perf_counter() - started

    async def export_pages(self, request):
        return await self.replica.export_pages(request)

    async def release_pages(self, request):
        return await self.replica.release_pages(request)

    async def read_pages(self, keys):
        return [(key, tokens, kv) for key, tokens, kv in await self.replica.engine.export_pages(keys)]

    def page_keys(self, tokens):
        return self.replica.engine.engine.page_keys(tokens)

    def num_leases(self):
        exporter = self.replica.ipc_exporter
        return 0 if exporter is None else exporter.num_leases

    def transport(self):
        return dict(self.client.transport_stats.pages), self.client.transport_stats.ipc_failures

    async def time_fetch(self, peer_id: str, keys, use_ipc: bool, rounds: int) -> list[float]:
        """Seconds to have ``keys``' pages on this replica's GPU from ``peer_id``, per round."""
        from replica.cuda_ipc import local_ipc_target

        self.client.ipc_target = local_ipc_target() if use_ipc else None
        times = []
        for _ in range(rounds):
            sync()
            started = time.perf_counter()
            pages = await self.client.fetch(peer_id, keys)
            on_device = [kv.to(DEVICE) for _, _, kv in pages]
            sync()
            times.append(time.perf_counter() - started)
            assert len(on_device) == len(keys)
        self.client.ipc_target = local_ipc_target()
        return times


def check_ray_peer_copy() -> None:
    try:
        import ray
    except ImportError:
        print("SKIP peer copy between Ray actors: ray is not installed here", flush=True)
        return
    import tempfile

    from bench.tiny_models import write_tiny_model

    ray.init(num_cpus=4, num_gpus=1 if DEVICE == "cuda" else 0, include_dashboard=False)
    try:
        tiny_dir = tempfile.mkdtemp(prefix="tiny-")
        write_tiny_model(tiny_dir, arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         vocab_size=1024, max_position_embeddings=2048)
        actor = ray.remote(num_gpus=0.5 if DEVICE == "cuda" else 0)(RayReplica)
        holder = actor.remote(tiny_dir, "holder", "float32")
        receiver = actor.remote(tiny_dir, "receiver", "float32", holder)
        where = ray.get([holder.where.remote(), receiver.where.remote()])
        print("actors (pid, CUDA_VISIBLE_DEVICES, GPU uuid):", where, flush=True)
        prefix = prompt(3 * 128 + 10, 30, 1024)
        first, second = prefix + prompt(20, 31, 1024), prefix + prompt(30, 32, 1024)
        ray.get(holder.ask.remote(first, "a"))
        tokens, cached, _ = ray.get(receiver.ask.remote(second, "b", "holder"))
        reference = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32,
                                                         attn_implementation="eager").to(DEVICE).eval()
        reference.generation_config.eos_token_id = None
        keys = ray.get(receiver.page_keys.remote(second))[:3]
        held, copied = ray.get([holder.read_pages.remote(keys), receiver.read_pages.remote(keys)])
        same = len(held) == len(copied) == 3 and all(torch.equal(a[2], b[2]) for a, b in zip(held, copied))
        time.sleep(0.5)
        transport, failures = ray.get(receiver.transport.remote())
        leases = ray.get(holder.num_leases.remote())
        check("peer copy between Ray actors by CUDA IPC: output equals reference, pages bit-identical, lease released",
              tokens == generate(reference, second, 6) and cached["peer"] == 384 and same
              and transport == {"cuda_ipc": 0, "shared_memory": 0, "host": 0,
                                ("cuda_ipc" if DEVICE == "cuda" else "shared_memory"): 3}
              and failures == 0 and leases == 0,
              f"cached={cached} transport={transport} ipc_failures={failures} leases_left={leases}")

        ray.kill(holder)  # each actor holds half of the GPU: make room for the next two
        ray.kill(receiver)
        big_dir = tempfile.mkdtemp(prefix="big-")
        write_tiny_model(big_dir, arch="llama", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                         vocab_size=8192, max_position_embeddings=4096)
        big_dtype = "bfloat16" if DEVICE == "cuda" else "float32"  # (the CPU is only a dry run of this script)
        big_holder = actor.remote(big_dir, "big-holder", big_dtype, max_model_len=4096)
        big_receiver = actor.remote(big_dir, "big-receiver", big_dtype, big_holder, max_model_len=4096)
        for index in range(3):
            ray.get(big_holder.ask.remote(prompt(2112, 700 + index, 8192), f"warm{index}", max_tokens=1))
        computed = []
        for index in range(5):
            long_prefix = prompt(2048, 800 + index, 8192)
            computed.append(ray.get(big_holder.ask.remote(long_prefix, f"p{index}", max_tokens=1))[2])
        keys = ray.get(big_holder.page_keys.remote(long_prefix))
        ray.get(big_receiver.time_fetch.remote("big-holder", keys, True, 3))  # warm up both paths
        ray.get(big_receiver.time_fetch.remote("big-holder", keys, False, 3))
        ipc = ray.get(big_receiver.time_fetch.remote("big-holder", keys, True, 10))
        host = ray.get(big_receiver.time_fetch.remote("big-holder", keys, False, 10))
        med = statistics.median
        print("\n| 2048-token prefix (16 pages, bf16, hidden 512 x 8), two Ray actors on one H200 | median |")
        print("|---|---|")
        print(f"| holder computes it (prefill, TTFT of a 1-token request) | {med(computed) * 1000:.2f} ms |")
        print(f"| receiver copies it by CUDA IPC (export, map, device-to-device copy, release) | "
              f"{med(ipc) * 1000:.2f} ms |")
        print(f"| receiver copies it through host memory (D2H, object store, H2D) | {med(host) * 1000:.2f} ms |")
        print(f"| host / CUDA IPC | {med(host) / med(ipc):.2f}x |", flush=True)
    finally:
        ray.shutdown()


def main() -> int:
    print("torch", torch.__version__, "device", torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
          flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    only = os.environ.get("GPU_CHECK_ONLY")  # e.g. "ray" to run one part
    if only in (None, "engine"):
        for arch in ("llama", "qwen2", "mistral"):
            check_equivalence(arch)
            os.environ[CUDA_COMPILE_ENV] = "0"
            check_equivalence(arch)
            del os.environ[CUDA_COMPILE_ENV]
            check_equivalence(arch, enforce_eager=True)
        check_device_peer_copy()
        timing_table()
    if only in (None, "ray"):
        check_ray_peer_copy()
    print("FAILURES:", FAILURES or "none")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
