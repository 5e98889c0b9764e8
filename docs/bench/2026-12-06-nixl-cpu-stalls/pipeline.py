import httpx, time, json, sys, itertools
M="/root/.cache/prefill-server/models/SmolLM2-135M-Instruct"
kinds=[("/v1/completions",{"prompt":"The sky is","max_tokens":3,"temperature":0,"logprobs":2,"stream":True}),
       ("/v1/completions",{"prompt":"The sky is","max_tokens":3,"temperature":0,"echo":True,"stream":True}),
       ("/v1/chat/completions",{"messages":[{"role":"system","content":"You are a cat."}],"max_tokens":6,"temperature":0,"stream":True}),
       ("/v1/completions",{"prompt":"The sky is","max_tokens":3,"temperature":0,"logprobs":2}),
       ("/v1/completions",{"prompt":list(range(100,164)),"max_tokens":5,"temperature":0,"stream":True}),]
N=int(sys.argv[1]); res={"pipe":[], "alone":[]}
def one(url,p,b):
    t=time.time(); ts=[]
    if b.get("stream"):
        with httpx.stream("POST", url+p, json=b, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:"): ts.append(time.time()-t)
    else:
        httpx.post(url+p, json=b, timeout=120); ts=[time.time()-t]
    return max([b2-a for a,b2 in zip(ts,ts[1:])]+[ts[0]]), ts
for i,(p,b) in zip(range(N), itertools.cycle(kinds)):
    b=dict(b, model=M)
    for name,url in (("pipe","http://127.0.0.1:8000"),("alone","http://127.0.0.1:8100")):
        g,ts=one(url,p,b); res[name].append(g)
        if g>3: print(f"  {name} #{i} {p} stream={b.get('stream',False)} at {time.strftime('%T')} stall {g:.1f}s chunks={[round(x,2) for x in ts]}", flush=True)
for k,v in res.items(): print(k, "n=",len(v), "stalls>3s:", sum(x>3 for x in v), "max", round(max(v),2), "sum", round(sum(v),1))
