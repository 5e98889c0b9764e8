"""Compile the Triton kernels for sm_90 on a machine without a GPU (Triton's bundled ptxas) and
report registers / spills / shared memory per launch variant. No device time needed.

    .venv/bin/python scripts/gpu/aot_check.py
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from prefill_server.kernels.block_sparse import estimate, kernel

TARGET = GPUTarget("cuda", 90, 32)
PTR = {"bf16": "*bf16", "i32": "*i32", "f32": "*fp32", "u8": "*u8"}


def attn_sig(fn):
    """Types by argument name: pointers as in ``kernel.attention``, scalars int32 except the scale."""
    ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32"}
    sig = {}
    for name in fn.arg_names:
        if name in ptr:
            sig[name] = ptr[name]
        elif name.isupper() and not name.startswith(("G", "BS", "BN", "D", "TOK", "MERGED")):
            sig[name] = "*i32"
        elif name == "qk_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_attn(mode, gp, tok, bn, nw, ns, maxnreg, dense=False):
    persistent = mode == "persistent"
    fn = kernel._attn_fwd_persistent if persistent else kernel._attn_fwd
    sig = attn_sig(fn)
    cx = dict(G=4, GP=gp, TOK=tok, BS=128, BN=bn, D=128, DENSE=dense)
    if not persistent:
        cx["MERGED"] = mode == "merged"
    sig.update({k: "constexpr" for k in cx})
    opts = {"num_warps": nw, "num_stages": ns}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    # what the runtime specialises at 128K: pointers and strides divisible by 16 (not CNT's row stride)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig.get(name, "").startswith("*") or (name.startswith("stride_") and name != "stride_cs")}
    src = ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
    return triton.compile(src, target=TARGET, options=opts)


def resources(ck) -> str:
    """Registers and spill bytes from the cubin (cuobjdump bundled with Triton)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        txt = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+).*?LOCAL:(\d+)", txt)
    return f"regs {m.group(1)} stack {m.group(2)} local {m.group(3)}" if m else txt[-300:]


def main():
    sys.path.insert(0, os.path.dirname(__file__))
    from bsa_tune import VARIANTS
    ok = True
    for var in VARIANTS:
        for dense in (False, True):
            try:
                ck = compile_attn(*var[:7], dense=dense)
                ir = ck.asm["ttgir"]
                print(var, "dense" if dense else "sparse", resources(ck), "smem", ck.metadata.shared,
                      "async copies", ir.count("async_copy_global_to_local"))
            except Exception as e:  # noqa: BLE001
                ok = False
                print(var, "FAILED", repr(e)[:1500])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
