"""vLLM's own P/D on CPU (NixlConnector both sides): the same request mix as the probe's t14, the
prefill vLLM at :8200, the decode vLLM at :8100, as vLLM's toy proxy does it."""
import httpx, itertools, sys, time
M = "/root/.cache/prefill-server/models/SmolLM2-135M-Instruct"
kinds = [("/v1/completions", {"prompt": "The sky is", "max_tokens": 3, "temperature": 0, "logprobs": 2, "stream": True}),
         ("/v1/completions", {"prompt": "The sky is", "max_tokens": 3, "temperature": 0, "echo": True, "stream": True}),
         ("/v1/completions", {"prompt": "The sky is", "max_tokens": 3, "temperature": 0, "logprobs": 2}),
         ("/v1/completions", {"prompt": list(range(100, 164)), "max_tokens": 5, "temperature": 0, "stream": True})]
N = int(sys.argv[1]); worst = []
for i, (p, b) in zip(range(N), itertools.cycle(kinds)):
    b = dict(b, model=M)
    t = time.time()
    pre = dict(b, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
               "remote_engine_id": None, "remote_block_ids": None, "remote_host": None, "remote_port": None})
    pre.pop("stream_options", None)
    r = httpx.post("http://127.0.0.1:8200" + p, json=pre, timeout=120).json()
    ktp = r["kv_transfer_params"]
    ts = []
    if b.get("stream"):
        with httpx.stream("POST", "http://127.0.0.1:8100" + p, json=dict(b, kv_transfer_params=ktp), timeout=120) as s:
            for line in s.iter_lines():
                if line.startswith("data:"):
                    ts.append(time.time() - t)
    else:
        httpx.post("http://127.0.0.1:8100" + p, json=dict(b, kv_transfer_params=ktp), timeout=120)
        ts = [time.time() - t]
    g = max([y - x for x, y in zip(ts, ts[1:])] + [ts[0]])
    worst.append(g)
    if g > 3:
        print(f"  #{i} {p} stream={b.get('stream', False)} at {time.strftime('%T')} stall {g:.1f}s", flush=True)
print("vllm P/D n=", len(worst), "stalls>3s:", sum(x > 3 for x in worst), "max", round(max(worst), 2),
      "sum", round(sum(worst), 1))
