"""Prefill load: 4 clients in a loop of 200-word completions with max_tokens 1."""
import asyncio, aiohttp, random, time, sys
URL = sys.argv[1]; DUR = float(sys.argv[2])
async def main():
    async with aiohttp.ClientSession() as s:
        m = (await (await s.get(URL + "/v1/models")).json())["data"][0]["id"]
        end = time.time() + DUR; n = 0
        async def worker():
            nonlocal n
            while time.time() < end:
                body = {"model": m, "prompt": " ".join(random.choice(["alpha","beta","gamma","delta"]) for _ in range(200)), "max_tokens": 1}
                async with s.post(URL + "/v1/completions", json=body) as r:
                    await r.read(); n += 1
        await asyncio.gather(*[worker() for _ in range(4)])
        print("requests", n)
asyncio.run(main())
