"""Compile the Triton kernels for sm_90 on a machine without a GPU (Triton's bundled ptxas) and
report registers / spills / shared memory per launch variant, and the SASS instruction mix of each
loop body (per thread and iteration: HGMMA, MUFU, FFMA, LDGSTS vs UTMALDG, spill loads LDL, ...).
No device time needed.

    .venv/bin/python docs/bench/2026-12-01-attention-fixm/aot_check.py
"""
from __future__ import annotations

import os
import collections
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


def compile_attn(mode, gp, tok, bn, nw, ns, maxnreg, ctas=None, fma=0, kvload=0, rcp=0, fixm=0, dense=False):
    persistent = mode == "persistent"
    if persistent:
        from prefill_server.kernels.block_sparse.persistent import _attn_fwd_persistent as fn
    else:
        fn = kernel._attn_fwd
    sig = attn_sig(fn)
    cx = dict(G=4, GP=gp, TOK=tok, BS=128, BN=bn, D=128, DENSE=dense)
    if not persistent:
        cx.update(MERGED=mode == "merged", FMA=bool(fma), KVLOAD=kvload, WS=False, RCP=bool(rcp), FIXM=int(fixm),
                  LIM=2.0 ** 64)
        desc = f"tensordesc<bf16[{bn}, 128]>" if kvload == 2 else "*bf16"
        sig.update(K_DESC=desc, V_DESC=desc)
    sig.update({k: "constexpr" for k in cx})
    opts = {"num_warps": nw, "num_stages": ns}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    # what the runtime specialises at 128K: pointers and strides divisible by 16 (not CNT's row stride)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig.get(name, "").startswith("*") or (name.startswith("stride_") and name != "stride_cs")}
    src = ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
    return triton.compile(src, target=TARGET, options=opts)


def _tool(name):
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def loop_mix(ck, min_len: int = 100) -> list[str]:
    """Instruction mix of each loop body (a backward branch and its target) of at least min_len."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        txt = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+(.*?);", txt)]
    keys = ("HGMMA", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "LDGSTS", "UTMALDG", "IMAD", "IADD3",
            "LEA", "LDL", "STL")
    out = []
    for addr, op in ins:
        m = re.search(r"BRA\s.*?(0x[0-9a-f]+)", op)
        if not m or int(m.group(1), 16) >= addr:
            continue
        body = [o.split()[1] if o.startswith("@") else o.split()[0]
                for a, o in ins if int(m.group(1), 16) <= a <= addr]
        if min_len <= len(body) < 1000:  # (the out-of-line mbarrier waits jump back into a loop)
            c = collections.Counter(b.split(".")[0] for b in body)
            out.append(f"loop {len(body)}: " + " ".join(f"{k} {c[k]}" for k in keys if c[k]))
    return out


def resources(ck) -> str:
    """Registers and spill bytes from the cubin (cuobjdump bundled with Triton)."""
    tool = _tool("cuobjdump")
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
                ck = compile_attn(*var, dense=dense)
                ir = ck.asm["ttgir"]
                print(var, "dense" if dense else "sparse", resources(ck), "smem", ck.metadata.shared,
                      "async copies", ir.count("async_copy_global_to_local"), "TMA loads",
                      ir.count("async_tma_copy_global_to_local"))
                for line in loop_mix(ck):
                    print("   ", line)
            except Exception as e:  # noqa: BLE001
                ok = False
                print(var, "FAILED", repr(e)[:1500])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
