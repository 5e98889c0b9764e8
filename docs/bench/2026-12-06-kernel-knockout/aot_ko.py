"""Compile ``knockout.py``'s ``_ko`` for sm_90 on a machine without a GPU (Triton's bundled ptxas, as
``aot_check.py``) and print registers / stack / shared memory and each loop body's instruction mix,
for the shipped copy (KO 0) and the persistent item loop (KO 512). No device time needed.

    .venv/bin/python docs/bench/2026-12-06-kernel-knockout/aot_ko.py
"""
import sys

import triton
from triton.compiler import ASTSource

sys.path.insert(0, "docs/bench/2026-12-01-attention-fixm")
sys.path.insert(0, "docs/bench/2026-12-06-kernel-knockout")
import aot_check as a  # noqa: E402
import knockout as ko  # noqa: E402

fn = ko._ko
for KO in (0, 512):
    sig = a.attn_sig(fn)
    cx = dict(G=4, GP=4, TOK=32, BS=128, BN=64, D=128, LIM=2.0 ** 64, KO=KO)
    sig.update(K_DESC="tensordesc<bf16[64, 128]>", V_DESC="tensordesc<bf16[64, 128]>")
    sig.update({k: "constexpr" for k in cx})
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig.get(name, "").startswith("*") or (name.startswith("stride_") and name != "stride_cs")}
    ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs), target=a.TARGET,
                        options={"num_warps": 8, "num_stages": 2, "maxnreg": 128})
    print(f"KO {KO}: {a.resources(ck)}, shared {ck.metadata.shared} B")
    for line in a.loop_mix(ck):
        print("  ", line)
