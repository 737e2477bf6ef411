"""The direct-launch cache of nitrobrew.core.launch: which launches reuse a compiled kernel.

The direct path only runs on CUDA; here a stand-in kernel records how it was called, so the
keying (what Triton specializes on) is checked on CPU."""

import pytest
import torch

pytest.importorskip("triton")
from nitrobrew.core import launch as _launch  # noqa: E402


class FakeCompiled:
    function = "fn-handle"
    packed_metadata = "meta"

    def __init__(self, log):
        self.log = log

    def run(self, gx, gy, gz, stream, function, metadata, launch_meta, enter, exit_, *args):
        self.log.append(("direct", (gx, gy, gz), args))


class FakeKernel:
    arg_names = ["x", "out", "n", "stride", "scale", "BLOCK", "FLAG"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def jit(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return FakeCompiled(self.log)

        return jit


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setattr(_launch, "_direct_ok", lambda first: True)
    monkeypatch.setattr(_launch, "_stream", lambda device: 7)
    monkeypatch.setattr(_launch, "_CACHE", {})


def _kinds(k):
    return [entry[0] for entry in k.log]


def test_second_launch_goes_direct_with_constexprs_appended(direct):
    k = FakeKernel()
    x, out = torch.zeros(64), torch.zeros(64)
    for _ in range(2):
        _launch.launch(k, (3,), x, out, 64, 32, 0.5, BLOCK=16, FLAG=True, num_warps=4)
    assert _kinds(k) == ["jit", "direct"]
    assert k.log[1][1] == (3, 1, 1)
    assert k.log[1][2] == (x, out, 64, 32, 0.5, 16, True)  # positional args, then BLOCK, FLAG in order


@pytest.mark.parametrize("change", ["one", "not16", "int64", "misaligned", "dtype", "constexpr", "warps"])
def test_a_change_triton_specializes_on_compiles_again(direct, change):
    k = FakeKernel()
    x, out = torch.zeros(64), torch.zeros(64)
    base = dict(args=[x, out, 64, 32, 0.5], kw=dict(BLOCK=16, FLAG=True, num_warps=4))
    _launch.launch(k, (3,), *base["args"], **base["kw"])
    args, kw = list(base["args"]), dict(base["kw"])
    if change == "one":
        args[3] = 1  # an int equal to 1 is a constant to Triton
    elif change == "not16":
        args[2] = 63  # divisibility by 16 is an attribute
    elif change == "int64":
        args[2] = 2**33  # needs a 64-bit parameter
    elif change == "misaligned":
        args[0] = torch.zeros(65)[1:]  # 4-byte offset: not 16-byte aligned
    elif change == "dtype":
        args[1] = torch.zeros(64, dtype=torch.float64)
    elif change == "constexpr":
        kw["BLOCK"] = 32
    else:
        kw["num_warps"] = 8
    _launch.launch(k, (3,), *args, **kw)
    assert _kinds(k) == ["jit", "jit"]


def test_values_triton_does_not_specialize_on_reuse_the_kernel(direct):
    k = FakeKernel()
    x, out = torch.zeros(64), torch.zeros(64)
    _launch.launch(k, (3,), x, out, 64, 32, 0.5, BLOCK=16, FLAG=True)
    _launch.launch(k, (5, 2), torch.ones(64), torch.ones(64), 128, 48, 2.0, BLOCK=16, FLAG=True)
    assert _kinds(k) == ["jit", "direct"]
    assert k.log[1][1] == (5, 2, 1)


def test_off_cuda_every_launch_is_the_jit_one():
    k = FakeKernel()
    for _ in range(2):
        _launch.launch(k, (3,), torch.zeros(4), torch.zeros(4), 4, 1, 0.5, BLOCK=16, FLAG=False)
    assert _kinds(k) == ["jit", "jit"]


def test_an_empty_hook_chain_is_no_hook():
    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not _launch._hook_active(None)
    assert not _launch._hook_active(Chain([]))
    assert _launch._hook_active(Chain([print]))
    assert _launch._hook_active(print)


def test_host_grid_helpers_match_triton():
    import triton

    for n in range(1, 300):
        assert _launch.next_pow2(n) == triton.next_power_of_2(n)
        for b in (1, 16, 64, 100):
            assert _launch.cdiv(n, b) == triton.cdiv(n, b)
    assert _launch.cdiv(0, 16) == 0


def _gluon_desc(t, rows):
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from nitrobrew.attention import kernels_gluon as kg

    if not kg.HAVE_GLUON:
        pytest.skip("Gluon not in this Triton")
    return kg._desc(t, rows), hopper


@pytest.mark.parametrize("change", [None, "base", "rows", "dtype"])
def test_tma_descriptors_key_on_their_type_not_their_tensor(direct, change):
    """A Gluon kernel's descriptors: another tensor of the same type reuses the kernel (the launcher builds
    the tensor map from the base, shape and strides on every launch); another block shape or dtype does not."""
    k = FakeKernel()
    q = torch.zeros(1, 2, 64, 32, dtype=torch.bfloat16)
    d, _ = _gluon_desc(q, 16)
    _launch.launch(k, (3,), d, torch.zeros(4), 64, 32, 0.5, BLOCK=16, FLAG=True)
    other = torch.zeros(1, 2, 128, 32, dtype=torch.float16 if change == "dtype" else torch.bfloat16)
    d2, _ = _gluon_desc(q if change is None else other, 32 if change == "rows" else 16)
    _launch.launch(k, (3,), d2, torch.zeros(4), 64, 32, 0.5, BLOCK=16, FLAG=True)
    assert _kinds(k) == (["jit", "direct"] if change in (None, "base") else ["jit", "jit"])
    if change == "base":
        assert k.log[1][2][0] is d2  # the new tensor's descriptor is what runs


def test_inline_key_matches_the_per_argument_rule():
    """_arg_key inlines _spec for ints and tensors: the same key for every kind of argument."""
    hyp = pytest.importorskip("hypothesis")
    st = hyp.strategies

    ints = st.integers(min_value=-(2**64), max_value=2**64)
    scalars = st.one_of(ints, st.floats(allow_nan=False), st.booleans(), st.none())

    @hyp.given(st.lists(scalars, max_size=12), st.integers(0, 3))
    @hyp.settings(max_examples=200, deadline=None)
    def check(values, offset):
        t = torch.zeros(8)[offset:]  # 16-byte aligned only at offset 0
        args = [t, *values, torch.nn.Parameter(torch.zeros(2)), torch.zeros(2, dtype=torch.int64)]
        assert _launch._arg_key(args) == tuple(map(_launch._spec, args))

    check()
