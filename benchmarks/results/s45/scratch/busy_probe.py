import asyncio, collections, sys, httpx
URL = "http://127.0.0.1:8200"
prefix = " ".join(f"word{i % 97}" for i in range(1400))
async def one(client, i):
    r = await client.post(f"{URL}/v1/completions", json={"model": "tiny-llama", "prompt": prefix + f" question {i}",
                                                          "max_tokens": 48, "temperature": 0, "ignore_eos": True})
    return r.status_code, r.headers.get("x-prefixserve-replica") or r.headers.get("X-Replica")
async def main():
    async with httpx.AsyncClient(timeout=120) as client:
        print("warm", await one(client, -1))
        for wave in range(3):
            results = await asyncio.gather(*(one(client, 100 * wave + i) for i in range(int(sys.argv[1]))))
            print("wave", wave, collections.Counter(results))
        m = (await client.get(f"{URL}/metrics")).text
        for line in m.splitlines():
            if line.startswith(("prefixserve_lane_requests_total", "prefixserve_router_decisions_total")):
                print(line)
asyncio.run(main())
