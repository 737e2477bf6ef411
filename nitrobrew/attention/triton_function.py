"""Autograd Function and launchers around the Triton attention-KL kernels."""

from __future__ import annotations

from typing import Optional

import torch

from ..core import checks as ck
from ..core.checks import interpreter_enabled
from ..core.launch import cdiv
from ..core.slabs import scale_by_upstream
from .common import AttnSpec
from .kernels_bwd import launch_bwd_dk, launch_bwd_dq
from .kernels_fwd import DEFAULT_CONFIGS, LOG2E, launch_fwd, next_pow2_dim
from .kernels_tiles import key_bytes_per_query_head, program_grid, query_bytes_per_kv_head


class Side:
    """One side's (q, k, scale) and what its launches derive from them, worked out once per call."""

    __slots__ = ("q", "k", "scale", "G", "D", "BD", "prec")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, scale: float):
        self.q, self.k, self.scale = q, k, scale  # scale in natural units (alpha / T)
        self.G = q.shape[1] // k.shape[1]
        self.D = q.shape[-1]
        self.BD = next_pow2_dim(self.D)
        if q.dtype == torch.float32:
            self.prec = "ieee"
        elif q.dtype == torch.bfloat16 and interpreter_enabled():
            self.prec = "upcast"
        else:
            self.prec = "tf32"  # ignored for 16-bit inputs


def _last_contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def resolve_config(
    kind: str, user: Optional[dict], device: torch.device, max_bd: int, fp32: bool = False, grouped: bool = False
):
    """(BM, BN, num_warps, num_stages) for one kernel: user override, interpreter, or a default
    chosen for Hopper (register spills checked with ptxas for sm_90; see docs/attention.md)."""
    if user and kind in user:
        return tuple(user[kind])
    if device.type != "cuda" or interpreter_enabled():
        return DEFAULT_CONFIGS["interp"]
    if fp32 or max_bd > 128:  # fp32 dots run on FMA units; big head dims: small tiles avoid spills
        return DEFAULT_CONFIGS["small"]
    if kind == "dk" and grouped:  # the head loop of grouped-query attention costs registers
        return DEFAULT_CONFIGS["dk_grouped"]
    return DEFAULT_CONFIGS[kind]


def _kpm_args(kpm: Optional[torch.Tensor], fallback: torch.Tensor):
    if kpm is None:
        return fallback, 0, False
    k = kpm.to(torch.uint8).contiguous()
    return k, k.stride(0), True


def triton_forward(X: Side, Y: Side, kpm, spec: AttnSpec, lse_x=None, lse_y=None, cfg=None):
    """Launch the forward kernel. Returns (kl natural [B,H,Nq], lse_x, lse_y in log2 units), float32."""
    B, H, Nq, _ = X.q.shape
    Nk = X.k.shape[2]
    dev = X.q.device
    kl = torch.empty((B, H, Nq), dtype=torch.float32, device=dev)
    lsx, lsy = torch.empty_like(kl), torch.empty_like(kl)
    fp32 = torch.float32 in (X.q.dtype, Y.q.dtype)
    BM, BN, warps, stages = resolve_config("fwd", cfg, dev, max(X.BD, Y.BD), fp32)
    kpm_t, s_kpm, has_kpm = _kpm_args(kpm, kl)

    def fixed(lse):
        if lse is None:
            return kl, False
        lse = lse.to(torch.float32)
        return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).contiguous(), True

    lx_in, x_fixed = fixed(lse_x)
    ly_in, y_fixed = fixed(lse_y)
    # chosen by api.py (kernels_gluon.gluon_forward_supported); its update takes the row maxima of the raw
    # scores, which needs scales > 0 (api.py refuses others; this function is also called directly)
    if cfg and cfg.get("fwd_kernel") == "gluon" and X.scale > 0 and Y.scale > 0:
        from .kernels_gluon import launch_fwd_gluon, note_failure

        try:
            launch_fwd_gluon(
                X.q,
                X.k,
                Y.q,
                Y.k,
                lse_in=(lx_in, ly_in),
                out=(kl, lsx, lsy),
                scales=(X.scale * LOG2E, Y.scale * LOG2E),
                causal=spec.is_causal,
                causal_offset=spec.causal_offset,
                fixed=(x_fixed, y_fixed),
                config=cfg.get("fwd_gluon"),
            )
            return kl, lsx, lsy
        except Exception as err:  # a Triton release whose Gluon differs: the Triton kernel below
            note_failure(err)
    grid, section = program_grid(cdiv(Nq, BM), B * H, key_bytes_per_query_head(X.k, Y.k, H))
    launch_fwd(
        grid,
        X.q,
        X.k,
        Y.q,
        Y.k,
        lx_in,
        ly_in,
        kpm_t,
        kl,
        lsx,
        lsy,
        X.q.stride(0),
        X.q.stride(1),
        X.q.stride(2),
        X.k.stride(0),
        X.k.stride(1),
        X.k.stride(2),
        Y.q.stride(0),
        Y.q.stride(1),
        Y.q.stride(2),
        Y.k.stride(0),
        Y.k.stride(1),
        Y.k.stride(2),
        s_kpm,
        H,
        Nq,
        Nk,
        X.G,
        Y.G,
        X.scale * LOG2E,
        Y.scale * LOG2E,
        spec.causal_offset if spec.is_causal else 0,
        section,
        DX=X.D,
        DY=Y.D,
        BDX=X.BD,
        BDY=Y.BD,
        BM=BM,
        BN=BN,
        CAUSAL=spec.is_causal,
        HAS_KPM=has_kpm,
        X_FIXED=x_fixed,
        Y_FIXED=y_fixed,
        EVEN_M=Nq % BM == 0,
        EVEN_N=Nk % BN == 0,
        PREC_X=X.prec,
        PREC_Y=Y.prec,
        num_warps=warps,
        num_stages=stages,
    )
    return kl, lsx, lsy


def gluon_grad(kind: str, X: Side, Y: Side, spec: AttnSpec, *, rows: tuple, grad_x: bool, config=None):
    """One side's dq or dk (kind "dq" / "dk"; of side x if grad_x) from the Gluon kernels
    (kernels_gluon_bwd.py). rows: the forward's (lse_x, lse_y, kl), the upstream gradient and its
    multiplier, as triton_backward takes them; config: kernels_gluon_bwd.launch_bwd_gluon's."""
    from .kernels_gluon_bwd import launch_bwd_gluon

    lsx, lsy, kl, g, g_mult = rows
    side = X if grad_x else Y
    out = torch.empty_like(side.q if kind == "dq" else side.k)
    launch_bwd_gluon(
        kind,
        X.q,
        X.k,
        Y.q,
        Y.k,
        out=out,
        lse=(lsx, lsy),
        kl=kl,
        g=g,
        scales=(X.scale * LOG2E, Y.scale * LOG2E),
        out_scale=side.scale * (1.0 if g_mult is None else g_mult),
        causal=spec.is_causal,
        causal_offset=spec.causal_offset,
        grad_x=grad_x,
        g_scalar=g_mult is not None,
        config=config,
    )
    return out


def _gluon_grad_or_none(kind: str, X: Side, Y: Side, spec: AttnSpec, *, rows: tuple, grad_x: bool):
    """gluon_grad, or None where the launch failed (a Triton release whose Gluon differs: warned once, the
    Triton kernels run)."""
    from .kernels_gluon_bwd import note_failure

    try:
        return gluon_grad(kind, X, Y, spec, rows=rows, grad_x=grad_x)
    except Exception as err:  # the Triton kernels instead
        note_failure(err)
        return None


def triton_backward(X: Side, Y: Side, kpm, spec: AttnSpec, lsx, lsy, kl, g, need, cfg=None, g_mult=None):
    """need = dict(qx=bool, kx=bool, qy=bool, ky=bool). Returns dict of gradients (or None).
    g: the upstream gradient per row [B, H, Nq] float32, or with g_mult given a 0-dim tensor,
    the gradient of g_mult * (sum of the rows)."""
    B, H, Nq, _ = X.q.shape
    Nk = X.k.shape[2]
    dev = X.q.device
    out = {name: None for name in ("qx", "kx", "qy", "ky")}
    kpm_t, s_kpm, has_kpm = _kpm_args(kpm, kl)
    off = spec.causal_offset if spec.is_causal else 0
    max_bd = max(X.BD, Y.BD)
    fp32 = torch.float32 in (X.q.dtype, Y.q.dtype)
    g_scalar = g_mult is not None
    mult = g_mult if g_scalar else 1.0
    # chosen by api.py (kernels_gluon_bwd.gluon_backward_enabled, for the cases the Gluon forward supports):
    # one side's dq, and one side's dk when both sides' kv heads are grouped alike
    gluon = bool(cfg and cfg.get("bwd_kernel") == "gluon" and kpm is None)
    if gluon and need["qx"] != need["qy"]:
        out["qx" if need["qx"] else "qy"] = _gluon_grad_or_none(
            "dq", X, Y, spec, rows=(lsx, lsy, kl, g, g_mult), grad_x=need["qx"]
        )
    if gluon and need["kx"] != need["ky"] and X.G == Y.G:
        out["kx" if need["kx"] else "ky"] = _gluon_grad_or_none(
            "dk", X, Y, spec, rows=(lsx, lsy, kl, g, g_mult), grad_x=need["kx"]
        )
    if (need["qx"] or need["qy"]) and out["qx"] is None and out["qy"] is None:
        BM, BN, warps, stages = resolve_config("dq", cfg, dev, max_bd, fp32)
        dqx = torch.empty_like(X.q) if need["qx"] else kl
        dqy = torch.empty_like(Y.q) if need["qy"] else kl
        sx3 = dqx.stride()[:3] if need["qx"] else (0, 0, 0)
        sy3 = dqy.stride()[:3] if need["qy"] else (0, 0, 0)
        grid, section = program_grid(cdiv(Nq, BM), B * H, key_bytes_per_query_head(X.k, Y.k, H))
        launch_bwd_dq(
            grid,
            X.q,
            X.k,
            Y.q,
            Y.k,
            kpm_t,
            lsx,
            lsy,
            kl,
            g,
            dqx,
            dqy,
            X.q.stride(0),
            X.q.stride(1),
            X.q.stride(2),
            X.k.stride(0),
            X.k.stride(1),
            X.k.stride(2),
            Y.q.stride(0),
            Y.q.stride(1),
            Y.q.stride(2),
            Y.k.stride(0),
            Y.k.stride(1),
            Y.k.stride(2),
            *sx3,
            *sy3,
            s_kpm,
            H,
            Nq,
            Nk,
            X.G,
            Y.G,
            X.scale * LOG2E,
            Y.scale * LOG2E,
            X.scale * mult,
            Y.scale * mult,
            off,
            section,
            DX=X.D,
            DY=Y.D,
            BDX=X.BD,
            BDY=Y.BD,
            BM=BM,
            BN=BN,
            CAUSAL=spec.is_causal,
            HAS_KPM=has_kpm,
            EVEN_M=Nq % BM == 0,
            EVEN_N=Nk % BN == 0,
            NEED_X=need["qx"],
            NEED_Y=need["qy"],
            PREC_X=X.prec,
            PREC_Y=Y.prec,
            G_SCALAR=g_scalar,
            num_warps=warps,
            num_stages=stages,
        )
        out["qx"] = dqx if need["qx"] else None
        out["qy"] = dqy if need["qy"] else None

    def dk_launch(A: Side, Bs: Side, lsa, lsb, a_is_x: bool, also_b: bool):
        BM, BN, warps, stages = resolve_config(
            kind="dk", user=cfg, device=dev, max_bd=max_bd, fp32=fp32, grouped=A.G > 1
        )
        Hkva = A.k.shape[1]
        dka = torch.empty_like(A.k)
        dkb = torch.empty_like(Bs.k) if also_b else kl
        sb3 = dkb.stride()[:3] if also_b else (0, 0, 0)
        grid, section = program_grid(cdiv(Nk, BN), B * Hkva, query_bytes_per_kv_head(A.q, Bs.q, Hkva))
        launch_bwd_dk(
            grid,
            A.q,
            A.k,
            Bs.q,
            Bs.k,
            kpm_t,
            lsa,
            lsb,
            kl,
            g,
            dka,
            dkb,
            A.q.stride(0),
            A.q.stride(1),
            A.q.stride(2),
            A.k.stride(0),
            A.k.stride(1),
            A.k.stride(2),
            Bs.q.stride(0),
            Bs.q.stride(1),
            Bs.q.stride(2),
            Bs.k.stride(0),
            Bs.k.stride(1),
            Bs.k.stride(2),
            *dka.stride()[:3],
            *sb3,
            s_kpm,
            H,
            Hkva,
            Nq,
            Nk,
            A.G,
            Bs.G,
            A.scale * LOG2E,
            Bs.scale * LOG2E,
            A.scale * mult,
            Bs.scale * mult,
            off,
            section,
            DA=A.D,
            DB=Bs.D,
            BDA=A.BD,
            BDB=Bs.BD,
            BM=BM,
            BN=BN,
            CAUSAL=spec.is_causal,
            HAS_KPM=has_kpm,
            EVEN_M=Nq % BM == 0,
            EVEN_N=Nk % BN == 0,
            A_IS_X=a_is_x,
            ALSO_B=also_b,
            PREC_A=A.prec,
            PREC_B=Bs.prec,
            GROUPED=A.G > 1,
            G_SCALAR=g_scalar,
            num_warps=warps,
            num_stages=stages,
        )
        return dka, (dkb if also_b else None)

    if out["kx"] is None and out["ky"] is None:  # not from the Gluon dk above
        if need["kx"] and need["ky"] and X.G == Y.G:
            out["kx"], out["ky"] = dk_launch(X, Y, lsx, lsy, a_is_x=True, also_b=True)
        else:
            if need["kx"]:
                out["kx"], _ = dk_launch(X, Y, lsx, lsy, a_is_x=True, also_b=False)
            if need["ky"]:
                out["ky"], _ = dk_launch(Y, X, lsy, lsx, a_is_x=False, also_b=False)
    return out


# Forming the gradients in the forward (block_config "grads_in_forward", scalar reductions): the backward
# kernels are queued right behind the forward's instead of after the host's trip through the loss's return,
# the caller's code and the autograd engine. That trip idles the device only where the loss's backward
# follows its forward directly in a host-bound step (measured: a lone fwd+bwd at N = 4096, 0.91x the wall
# time); in a model whose layers each add a loss, the device has other work meanwhile, and the gradients
# would be held from the forward to the backward for nothing. So it is asked for, not the default
# (docs/attention.md, "Gradients formed in the forward").
_UNIT: dict = {}


def _unit_gradient(device: torch.device) -> torch.Tensor:
    """A 0-dim float32 1 on the device (the upstream gradient the forward's gradients are formed for),
    made once per device (outside CUDA graph captures)."""
    one = _UNIT.get(device)
    if one is None:
        one = torch.ones((), dtype=torch.float32, device=device)
        # made inside a CUDA graph capture, its fill runs only on replay: not kept for calls outside it
        if not (one.is_cuda and torch.cuda.is_current_stream_capturing()):
            _UNIT[device] = one
    return one


def _input_grads(S: Side, T: Side, *, kpm, spec: AttnSpec, rows: tuple, g, need4, cfg, g_mult):
    """(dq_s, dk_s, dq_t, dk_t) (None where not needed) from the forward's rows = (lse_x, lse_y, kl)."""
    lsx, lsy, kl = rows
    if spec.teacher_is_x:
        X, Y, need = T, S, dict(qx=need4[2], kx=need4[3], qy=need4[0], ky=need4[1])
    else:
        X, Y, need = S, T, dict(qx=need4[0], kx=need4[1], qy=need4[2], ky=need4[3])
    out = triton_backward(X=X, Y=Y, kpm=kpm, spec=spec, lsx=lsx, lsy=lsy, kl=kl, g=g, need=need, cfg=cfg, g_mult=g_mult)
    if spec.teacher_is_x:
        return out["qy"], out["ky"], out["qx"], out["kx"]
    return out["qx"], out["kx"], out["qy"], out["ky"]


def _forward(q_s, k_s, q_t, k_t, *, lse_t, kpm, spec: AttnSpec, cfg):
    """The sides and the forward kernel's (kl, lse_x, lse_y)."""
    S = Side(_last_contig(q_s), _last_contig(k_s), spec.scale_s)
    T = Side(_last_contig(q_t), _last_contig(k_t), spec.scale_t)
    if spec.teacher_is_x:
        return S, T, triton_forward(T, S, kpm, spec, lse_x=lse_t, cfg=cfg)
    return S, T, triton_forward(S, T, kpm, spec, lse_y=lse_t, cfg=cfg)


def _graph_needed(q_s, k_s, q_t, k_t) -> bool:
    return torch.is_grad_enabled() and (
        q_s.requires_grad or k_s.requires_grad or q_t.requires_grad or k_t.requires_grad
    )


class TritonAttentionKL(torch.autograd.Function):
    """Per-row KL [B, H, Nq] float32 (0 at rows with no visible key), or with ``reduce`` ("sum" or
    "mean") the scalar sum or mean of the rows: one autograd node and no host-side ops around the
    kernels (their host work is the dominant cost of small problems); the backward kernels read
    the scalar upstream gradient themselves. With ``grads_now`` (a scalar reduction) the forward also
    runs the backward kernels for an upstream gradient of 1 and the backward multiplies their results
    by the real one on the device, in one launch that returns at once when it is 1
    (``core.slabs.scale_by_upstream``); a second backward through the graph (retain_graph=True) runs the
    backward kernels again."""

    @staticmethod
    def forward(
        ctx, q_s, k_s, q_t, k_t, lse_t, kpm, spec: AttnSpec, cfg, reduce: Optional[str] = None, grads_now=False
    ):
        S, T, (kl, lsx, lsy) = _forward(q_s, k_s, q_t, k_t, lse_t=lse_t, kpm=kpm, spec=spec, cfg=cfg)
        ctx.save_for_backward(S.q, S.k, T.q, T.k, kpm, lsx, lsy, kl)
        ctx.spec, ctx.cfg = spec, cfg
        ctx.g_mult = None if reduce is None else (1.0 if reduce == "sum" else 1.0 / kl.numel())
        ctx.grads = None
        if grads_now and reduce is not None:
            g = _unit_gradient(kl.device)
            need4 = ctx.needs_input_grad[:4]
            ctx.grads = _input_grads(
                S, T, kpm=kpm, spec=spec, rows=(lsx, lsy, kl), g=g, need4=need4, cfg=cfg, g_mult=ctx.g_mult
            )
        if reduce is None:
            return kl
        return kl.sum() if reduce == "sum" else kl.mean()

    @staticmethod
    @ck.no_double_backward
    def backward(ctx, grad_rows):
        if ctx.grads is not None:  # formed in the forward; handed out once (autograd may keep them as .grad)
            grads, ctx.grads = ctx.grads, None
            return (*scale_by_upstream(grads, grad_rows), None, None, None, None, None, None)
        q_s, k_s, q_t, k_t, kpm, lsx, lsy, kl = ctx.saved_tensors
        spec = ctx.spec
        S = Side(q_s, k_s, spec.scale_s)
        T = Side(q_t, k_t, spec.scale_t)
        g = grad_rows if grad_rows.dtype == torch.float32 else grad_rows.float()
        if ctx.g_mult is None:
            g = g.contiguous()
        need4 = ctx.needs_input_grad[:4]
        grads = _input_grads(
            S, T, kpm=kpm, spec=spec, rows=(lsx, lsy, kl), g=g, need4=need4, cfg=ctx.cfg, g_mult=ctx.g_mult
        )
        return (*grads, None, None, None, None, None, None)


def attention_rows(q_s, k_s, q_t, k_t, lse_t, kpm, spec: AttnSpec, cfg: Optional[dict] = None):
    if not _graph_needed(q_s, k_s, q_t, k_t):  # no autograd node to build (no_grad, inference, frozen inputs)
        return _forward(q_s, k_s, q_t, k_t, lse_t=lse_t, kpm=kpm, spec=spec, cfg=cfg)[2][0]
    return TritonAttentionKL.apply(q_s, k_s, q_t, k_t, lse_t, kpm, spec, cfg)


def triton_total(q_s, k_s, q_t, k_t, lse_t, spec: AttnSpec, cfg: Optional[dict], reduce: str):
    """Sum or mean of the per-row KL (every row counts: no masks). With block_config "grads_in_forward", under
    grad mode and with an input that requires grad, the gradients are formed in the forward."""
    if not _graph_needed(q_s, k_s, q_t, k_t):
        kl = _forward(q_s, k_s, q_t, k_t, lse_t=lse_t, kpm=None, spec=spec, cfg=cfg)[2][0]
        return kl.sum() if reduce == "sum" else kl.mean()
    grads_now = bool(cfg and cfg.get("grads_in_forward")) and not torch.compiler.is_compiling()
    return TritonAttentionKL.apply(q_s, k_s, q_t, k_t, lse_t, None, spec, cfg, reduce, grads_now)
