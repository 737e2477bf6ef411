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


# A launcher of Triton 3.6's form (triton/backends/nvidia/driver.py): a C launch behind a wrapper that
# expands each descriptor argument with the module's make_tensordesc_arg. Its module is registered so that
# core.launch finds the driver by the launcher's __module__.
_DRIVER_36 = "nitrobrew_test_driver_36"


def _driver_36():
    import types

    mod = types.ModuleType(_DRIVER_36)
    mod._BASE_ARGS_FORMAT_LEN = 13
    mod.fills = []

    def make_tensordesc_arg(arg, metadata):
        mod.fills.append((arg.name, metadata["block_size"]))
        return [("map", arg.name, tuple(metadata["block_size"])), *arg.shape, *arg.strides]

    mod.make_tensordesc_arg = make_tensordesc_arg

    def wrap(launcher, tensordesc_indices, tensordesc_meta):
        def inner(*args):  # the 3.6 wrapper, as written there
            final_args = list(args[: mod._BASE_ARGS_FORMAT_LEN])
            tensordesc_idx = 0
            for i, arg in enumerate(args[mod._BASE_ARGS_FORMAT_LEN :]):
                if i in tensordesc_indices:
                    final_args.extend(mod.make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                    tensordesc_idx += 1
                else:
                    final_args.append(arg)
            return launcher(*final_args)

        return inner

    class CudaLauncher:
        global_scratch_size = 0
        profile_scratch_size = 0
        launch_cooperative_grid = False
        launch_pdl = False

        def __init__(self, c_calls, indices, metas):
            self.launch = wrap(lambda *a: c_calls.append(a), indices, metas)

        def __call__(self, gx, gy, gz, stream, function, *args):
            self.launch(gx, gy, gz, stream, function, False, False, None, None, *args)

    CudaLauncher.__module__ = _DRIVER_36
    mod.CudaLauncher = CudaLauncher
    return mod


class FakeDesc:
    def __init__(self, name, shape=(256, 64), strides=(64, 1)):
        self.name, self.shape, self.strides = name, list(shape), list(strides)
        self.block_shape, self.layout = [64, 64], "nvmma"
        self.base = torch.zeros(1)


class DescKernel:
    arg_names = ["a_desc", "b_desc", "out", "n", "BLOCK"]

    def __init__(self, launcher):
        self.launcher, self.jit_calls = launcher, 0

    def __getitem__(self, grid):
        def jit(*args, **kwargs):
            self.jit_calls += 1
            compiled = type("Compiled", (), {})()
            compiled.run, compiled.function, compiled.packed_metadata = self.launcher, "fn", "meta"
            return compiled

        return jit


@pytest.fixture
def driver_36(direct, monkeypatch):
    import sys

    mod = _driver_36()
    monkeypatch.setitem(sys.modules, _DRIVER_36, mod)
    return mod


@pytest.mark.parametrize("keep", [True, False])
def test_kept_tensor_maps_reach_the_c_launch_as_the_wrapper_builds_them(driver_36, monkeypatch, keep):
    monkeypatch.setattr(_launch, "KEEP_TENSOR_MAPS", keep)
    metas = [{"block_size": [64, 64], "swizzle": 128}, {"block_size": [128, 64], "swizzle": 128}]
    c_calls: list = []
    kernel = DescKernel(driver_36.CudaLauncher(c_calls, {0, 1}, metas))
    a, b, out = FakeDesc("a"), FakeDesc("b", shape=(512, 64)), torch.zeros(4)
    _launch.launch(kernel, (2,), a, b, out, 7, BLOCK=64)  # the JIT launch makes the entry
    for _ in range(3):
        _launch.launch(kernel, (2, 3), a, b, out, 7, BLOCK=64)
    assert kernel.jit_calls == 1 and len(c_calls) == 3
    expected = (2, 3, 1, 7, "fn", False, False, None, None, "meta", None, None, None)
    expected += (("map", "a", (64, 64)), 256, 64, 64, 1, ("map", "b", (128, 64)), 512, 64, 64, 1, out, 7, 64)
    assert all(call == expected for call in c_calls)
    # kept: each descriptor's map is encoded once for this kernel's metadata; else on every launch
    assert len(driver_36.fills) == (2 if keep else 6)
    assert isinstance(_launch._CACHE and next(iter(_launch._CACHE.values()))[0], _launch._KeptMapsRun) == keep


def test_kept_tensor_maps_are_per_kernel_metadata(driver_36):
    metas_a, metas_b = [{"block_size": [64, 64]}], [{"block_size": [128, 64]}]
    calls_a: list = []
    calls_b: list = []
    k_a = DescKernel(driver_36.CudaLauncher(calls_a, {0}, metas_a))
    k_b = DescKernel(driver_36.CudaLauncher(calls_b, {0}, metas_b))
    d = FakeDesc("d")
    for k in (k_a, k_b, k_a, k_b):
        _launch.launch(k, (1,), d, FakeDesc("other"), torch.zeros(1), 3, BLOCK=64)
        _launch.launch(k, (1,), d, FakeDesc("other"), torch.zeros(1), 3, BLOCK=64)
    assert calls_a[0][13] == ("map", "d", (64, 64)) and calls_b[0][13] == ("map", "d", (128, 64))
    assert all(c[13] == calls_a[0][13] for c in calls_a) and all(c[13] == calls_b[0][13] for c in calls_b)
    assert [f for f in driver_36.fills if f[0] == "d"] == [("d", [64, 64]), ("d", [128, 64])]


@pytest.mark.parametrize("unlike", ["scratch", "base_len", "no_meta", "keyword_desc", "no_descs"])
def test_a_launcher_of_another_form_keeps_tritons_wrapper(driver_36, unlike):
    metas = [{"block_size": [64, 64]}]
    c_calls: list = []
    launcher = driver_36.CudaLauncher(c_calls, {0}, metas)
    if unlike == "scratch":
        launcher.global_scratch_size = 128
    elif unlike == "base_len":
        driver_36._BASE_ARGS_FORMAT_LEN = 14
    elif unlike == "no_meta":
        launcher = driver_36.CudaLauncher(c_calls, {0}, [None])
    elif unlike == "keyword_desc":
        launcher = driver_36.CudaLauncher(c_calls, {3}, metas)
    else:
        launcher.launch = print  # a builtin: Triton returns the C launch itself when nothing is a descriptor
    assert _launch._kept_maps_run(launcher, n_positional=3) is None
