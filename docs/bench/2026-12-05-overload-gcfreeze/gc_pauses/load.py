"""480 completions of ~150 words, max_tokens 1, 8 at a time, against the probe server on port 8123."""
import asyncio, aiohttp, random, time
async def main():
    async with aiohttp.ClientSession() as s:
        async def one(i):
            body = {"prompt": " ".join(random.choice(["alpha","beta","gamma","delta"]) for _ in range(150)), "max_tokens": 1}
            async with s.post("http://127.0.0.1:8123/v1/completions", json=body) as r:
                await r.read(); return r.status
        sts = []
        t=time.time()
        for k in range(60):
            sts += await asyncio.gather(*[one(i) for i in range(8)])
        print(time.time()-t, {x: sts.count(x) for x in set(sts)})
asyncio.run(main())
