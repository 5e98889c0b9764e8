"""The warp-specialised kernel (``ws_kernel``) compiled for sm_90 on this CPU machine with the ptxas and
cuobjdump that ship in the Triton wheel: it must compile, hold its registers without spilling, and fit
Hopper's shared memory. The GPU tests run it; this catches, without a GPU, a Triton whose Gluon no
longer builds it (the engine would then fall back to the Triton kernel at its first launch) and a
change that pushes it past its register or shared-memory budget (which on the GPU shows up as a
launch failure or a spilling, slower kernel).

The compile runs in a child process: the kernel tests run Triton's interpreter on a CPU machine, and
a kernel defined under it cannot be compiled."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

HOPPER_SMEM = 227 * 1024  # the most one CTA may take on sm_90
TOOL_DIR = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
if not os.path.exists(os.path.join(TOOL_DIR, "cuobjdump")):
    pytest.skip("this Triton wheel ships no CUDA tools", allow_module_level=True)


def _compile(g: int):
    """``ws_kernel._attn_ws`` as ``ws_kernel.attention`` launches it for a group of ``g`` query heads
    per KV head, bf16, D = 128, 128-token blocks."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from prefill_server.kernels.block_sparse import kernel, ws_kernel
    fn = ws_kernel._attn_ws
    d = 128

    def desc(rows):
        lay = gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, {d}],{lay!r}>"
    cx = dict(G=g, GP=ws_kernel.GP, TOK=ws_kernel.TOK, BS=128, BN=ws_kernel.BN, BD=ws_kernel.BD, D=d,
              STAGES=ws_kernel.STAGES, LIM=kernel.FIXM_LIMIT[torch.bfloat16],
              LOADER_REGS=ws_kernel.LOADER_REGS, COMPUTE_REGS=ws_kernel.COMPUTE_REGS, num_warps=ws_kernel.WARPS)
    types = {"q_desc": desc(ws_kernel.TOK), "o_desc": desc(ws_kernel.TOK), "k_desc": desc(ws_kernel.BN),
             "v_desc": desc(ws_kernel.BN), "kd_desc": desc(ws_kernel.BD), "vd_desc": desc(ws_kernel.BD),
             "O": "*bf16", "LSE": "*fp32", "qk_scale": "fp32"}
    sig = {}
    for name in fn.arg_names:
        if name in cx:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        else:  # the int32 tables (FLAGS, CU_Q, ..., CNT) and the int32 counts and strides
            sig[name] = "*i32" if name.isupper() else "i32"
    # (what the runtime specialises on: pointers and all strides but CNT's row stride divisible by 16)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name].startswith("*") or (name.startswith("stride_") and name != "stride_cs")}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": ws_kernel.WARPS, "maxnreg": ws_kernel.MAXNREG})


def _usage(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        txt = subprocess.run([os.path.join(TOOL_DIR, "cuobjdump"), "-res-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?LOCAL:(\d+)", txt)
    assert m, txt
    return {"regs": int(m.group(1)), "stack": int(m.group(2)), "local": int(m.group(3))}


def _report(g: int) -> dict:
    """What the test checks, from a compile in this process (run as a script: no interpreter)."""
    from prefill_server.kernels.block_sparse import ws_kernel
    ck = _compile(g)
    ptx = ck.asm["ptx"]
    return {**_usage(ck.asm["cubin"]), "shared": ck.metadata.shared, "maxnreg": ws_kernel.MAXNREG,
            "setmaxnreg": "setmaxnreg" in ptx, "tma": "cp.async.bulk.tensor" in ptx, "wgmma": "wgmma" in ptx}


@pytest.mark.parametrize("g", [4, 8])  # Llama-3.1-8B's group of 4 query heads per KV head; 8 (70B)
def test_the_warp_specialised_kernel_compiles_for_sm90_within_its_budgets(g):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, os.path.abspath(__file__), str(g)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    use = json.loads(run.stdout.strip().splitlines()[-1])
    assert use["regs"] <= use["maxnreg"], use
    assert use["stack"] == 0 and use["local"] == 0, f"the kernel spills: {use}"
    assert use["shared"] <= HOPPER_SMEM, use
    # the loader and the compute partitions take their own register counts, K/V arrive by TMA, the
    # products run on wgmma
    assert use["setmaxnreg"] and use["tma"] and use["wgmma"], use


if __name__ == "__main__":
    print(json.dumps(_report(int(sys.argv[1]))))
