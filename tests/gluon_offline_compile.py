"""Compile the Gluon attention forward for sm90 on a machine without a GPU (run as a script, outside the
Triton interpreter, by tests/test_attention_gluon.py): nothing is launched; the installed Triton's Gluon
front end and NVIDIA back end build the kernel, so a renamed or removed Gluon builtin fails here, on CPU.
Prints the cubins' sizes (the one-warpgroup and the warp-specialized forward, the dq and dk kernels)."""

from __future__ import annotations

import sys

import torch
from triton.backends.compiler import GPUTarget

from nitrobrew.attention import kernels_gluon as kg
from nitrobrew.attention import kernels_gluon_bwd as kgb

driver_module = sys.modules["triton.runtime.driver"]


class Sm90Target:
    """The parts of Triton's active driver that compiling (not launching) reads."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def main() -> int:
    if not kg.HAVE_GLUON:
        print("no Gluon in this Triton")
        return 3
    b, h, n, d = 1, 2, 256, 64
    q = torch.empty(b, h, n, d, dtype=torch.bfloat16)
    rows = torch.empty(b, h, n)
    tail = (rows, rows, rows, rows, rows, h, n, n, 1, 1, 1.0, 1.0, 0, 1)
    driver_module.driver.set_active(Sm90Target())  # for this process, which compiles and exits
    bm, bn, warps, stages = kg.DEFAULT_CONFIG
    desc_q, desc_k = kg._desc(q, bm), kg._desc(q, bn)
    one_warpgroup = kg.attention_fwd_gluon_kernel.warmup(
        *(desc_q, desc_k, desc_q, desc_k, *tail),
        BN=bn,
        STAGES=stages,
        CAUSAL=True,
        X_FIXED=False,
        Y_FIXED=False,
        num_warps=warps,
        grid=(1,),
    )
    print("one-warpgroup cubin bytes", len(one_warpgroup.asm["cubin"]))
    desc_q, desc_k = kg._desc(q, kg.WS_ROWS), kg._desc(q, kg.WS_BN)
    warp_specialized = kg.attention_fwd_gluon_ws_kernel.warmup(
        *(desc_q, desc_k, desc_q, desc_k, *tail),
        STAGES=kg.WS_STAGES,
        CAUSAL=True,
        X_FIXED=True,
        Y_FIXED=False,
        CONSUMER_REGS=kg.WS_CONSUMER_REGS,
        PRODUCER_REGS=kg.WS_PRODUCER_REGS,
        num_warps=4,
        grid=(1,),
    )
    print("warp-specialized cubin bytes", len(warp_specialized.asm["cubin"]))
    # the backward's dq and dk kernels (kernels_gluon_bwd), each side's formula once
    grads = (rows, rows, rows, rows, q, h, n, n)
    descs = (kg._desc(q, kgb.DQ_ROWS), kg._desc(q, kgb.DQ_BN), kg._desc(q, kgb.DQ_ROWS), kg._desc(q, kgb.DQ_BN))
    dq = kgb.attention_bwd_dq_gluon_ws_kernel.warmup(
        *descs, *grads, 1, 1, 1.0, 1.0, 1.0, 0, 1,
        STAGES=kgb.DQ_STAGES, CAUSAL=True, GRAD_X=False, G_SCALAR=True,
        CONSUMER_REGS=kgb.DQ_CONSUMER_REGS, PRODUCER_REGS=kgb.DQ_PRODUCER_REGS, num_warps=4,
        grid=(1,),
    )  # fmt: skip
    print("dq cubin bytes", len(dq.asm["cubin"]))
    descs = (kg._desc(q, kgb.DK_KEYS), kg._desc(q, kgb.DK_BQ), kg._desc(q, kgb.DK_KEYS), kg._desc(q, kgb.DK_BQ))
    dk = kgb.attention_bwd_dk_gluon_ws_kernel.warmup(
        *descs, *grads, 1, 1.0, 1.0, 1.0, 0, 1,
        STAGES=kgb.DK_STAGES, CAUSAL=True, GRAD_X=True, G_SCALAR=False,
        CONSUMER_REGS=kgb.DQ_CONSUMER_REGS, PRODUCER_REGS=kgb.DQ_PRODUCER_REGS, num_warps=4,
        grid=(1,),
    )  # fmt: skip
    print("dk cubin bytes", len(dk.asm["cubin"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
