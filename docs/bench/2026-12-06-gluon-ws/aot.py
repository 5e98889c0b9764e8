"""Compile ``ws_attention._attn_ws`` for sm_90 on a machine without a GPU (Triton's bundled ptxas):
registers, spills, shared memory and each loop's instruction mix, per variant. No device time.

    .venv/bin/python docs/bench/2026-12-06-gluon-ws/aot.py [BN STAGES ...]
"""
from __future__ import annotations

import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "2026-12-01-attention-fixm"))
import ws_attention  # noqa: E402
from aot_check import loop_mix, resources  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_ws(bn=64, stages=4, tok=32, gp=4, dense=False, maxnreg=168, loader_regs=24, fixed=0, nwg=1,
               compute_regs=216, bd=0, peel=1, pipe=0, tstore=0, pp=0, **extra):
    fn = ws_attention._attn_ws
    q_lay = gl.NVMMASharedLayout.get_default_for([tok, 128], gl.bfloat16)
    kv_lay = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.bfloat16)
    sig = {}
    for name in fn.arg_names:
        if name in ("q_desc", "o_desc"):
            sig[name] = f"tensordesc<bf16[{tok}, 128],{q_lay!r}>"
        elif name in ("k_desc", "v_desc"):
            sig[name] = f"tensordesc<bf16[{bn}, 128],{kv_lay!r}>"
        elif name in ("kd_desc", "vd_desc"):
            sig[name] = f"tensordesc<bf16[{bd or bn}, 128],{kv_lay!r}>"
        elif name == "O":
            sig[name] = "*bf16"
        elif name == "LSE":
            sig[name] = "*fp32"
        elif name.isupper() and name not in ("G", "GP", "TOK", "BS", "BN", "D", "DENSE", "STAGES", "LOADER_REGS", "FIXED", "LIM", "NWG", "COMPUTE_REGS", "BD", "PEEL", "PIPE", "TSTORE", "PP"):
            sig[name] = "*i32"
        elif name == "qk_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    cx = dict(G=4, GP=gp, TOK=tok, BS=128, BN=bn, D=128, DENSE=dense, STAGES=stages, LOADER_REGS=loader_regs,
              FIXED=bool(fixed), LIM=2.0 ** 64, NWG=nwg, COMPUTE_REGS=compute_regs, BD=bd or bn, PEEL=bool(peel), PIPE=bool(pipe), TSTORE=bool(tstore), PP=bool(pp),
              num_warps=8 if nwg == 1 else 4, **extra)
    cx = {k: v for k, v in cx.items() if k in fn.arg_names or k == "num_warps"}
    sig.update({k: "constexpr" for k in cx})
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig.get(name, "").startswith("*") or name in ("stride_ot", "stride_oh", "stride_is", "stride_ih")}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": cx["num_warps"], "maxnreg": maxnreg})


if __name__ == "__main__":
    variants = [(64, 4), (128, 2)]
    if len(sys.argv) > 1:
        a = [int(x) for x in sys.argv[1:]]
        variants = list(zip(a[::2], a[1::2]))
    for bn, st in variants:
        for dense in (False, True):
            ck = compile_ws(bn, st, dense=dense)
            print(f"bn {bn} stages {st} {'dense' if dense else 'sparse'}:", resources(ck), "smem", ck.metadata.shared)
            for line in loop_mix(ck, 60):
                print("   ", line)
