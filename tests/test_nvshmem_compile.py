"""The NVSHMEM device binding compiles for Hopper from stock Triton with NVSHMEM's bitcode linked (no GPU
needed), and the pairing check refuses the versions that do not link.

The compile test is skipped, with the reason, where the bitcode wheel is not installed (``make test``
installs the pinned one). The kernels' own put paths are compiled by ``compile_report`` (see
tests/test_compile_sm90.py); this file checks the binding itself and its host-side checks.
"""

import re

import pytest
import triton
import triton.language as tl

from moe_comm.triton_kernels import nvshmem_bitcode as nb
from moe_comm.triton_kernels import nvshmem_device as nv


def _bitcode_or_skip():
    try:
        return nb.launch_options()
    except nb.NvshmemSetupError as e:
        pytest.skip(f"NVSHMEM device bitcode unusable here: {e}")


@triton.jit
def _every_call(dst, src, sig, nbytes, pe):
    nv.putmem_nbi_block(dst, src, nbytes, pe)
    nv.fence()
    nv.putmem_signal_nbi_block(dst, src, nbytes, sig, 7, nv.SIGNAL_SET, pe)
    nv.signal_op(sig, 1, nv.SIGNAL_ADD, pe)
    nv.uint64_atomic_add(sig, 1, pe)
    nv.int64_p(sig, 3, pe)
    nv.quiet()
    v = nv.signal_wait_until(sig, nv.CMP_GE, 8)
    tl.store(src, (v + nv.ptr(dst, pe)).to(tl.int32))


@pytest.mark.timeout(300)
@pytest.mark.ptx
def test_every_binding_call_links_into_an_sm90a_cubin():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    opts = _bitcode_or_skip()
    compiled = triton.compile(ASTSource(_every_call, dict(dst="*i32", src="*i32", sig="*i64", nbytes="i64",
                                                          pe="i32"), {}),
                              target=GPUTarget("cuda", 90, 32), options=opts)
    ptx, llir, ttir = compiled.asm["ptx"], compiled.asm["llir"], compiled.asm["ttir"]
    assert len(compiled.asm["cubin"]) > 0
    # Linked: the kernel calls every NVSHMEM function (an extern call of that symbol in the Triton IR), and
    # after linking none is left a declaration in the LLVM IR (each was defined from the bitcode, then
    # inlined or kept; whether LLVM leaves a ``%<name>.exit`` label in the PTX differs between versions),
    # nor an external function in the PTX.
    for name in nv.C_FUNCTIONS:
        assert re.search(rf'symbol = "{name}"', ttir), f"{name} not called"
        assert not re.search(rf"^declare [^\n]*@{name}\(", llir, re.M), f"{name} not linked"
    assert not [line for line in ptx.splitlines() if ".extern" in line and "nvshmem" in line]
    # The module holds NVSHMEM's device state: it needs nvshmemx_cumodule_init before its first launch.
    assert "nvshmemi_device_state_d" in ptx


@triton.jit
def _one_thread_calls(sig, pe):
    nv.fence()
    nv.signal_op(sig, 1, nv.SIGNAL_SET, pe)
    nv.quiet()


# The thread-index read of ``nvshmem_device._first_thread`` (inline asm: Triton's own reads are not
# between "begin inline asm" markers; Triton 3.9 puts a ``.loc`` line inside them) and the predicate
# "not thread 0" set from it.
_TID_GUARD = re.compile(r"// begin inline asm\s+(?:\.loc[^\n]*\s+)*"
                        r"mov\.u32 (%r\d+), %tid\.x;\s+// end inline asm.*?"
                        r"setp\.ne\.b32\s+(%p\d+), \1, 0;", re.S)


@pytest.mark.timeout(300)
@pytest.mark.ptx
def test_signal_fence_and_quiet_are_issued_by_one_thread():
    """``signal_op``, ``fence`` and ``quiet`` compile to a call that only thread 0 of the program makes
    (the others branch around it): on IBGDA each is a network operation, not to be sent once per thread."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    opts = _bitcode_or_skip()
    compiled = triton.compile(ASTSource(_one_thread_calls, dict(sig="*i64", pe="i32"), {}),
                              target=GPUTarget("cuda", 90, 32), options=dict(opts, num_warps=4))
    ptx = compiled.asm["ptx"]
    body = ptx[ptx.index(".entry"):]
    body = body[:body.index(".func")] if ".func" in body else body   # the kernel, not NVSHMEM's helpers
    guard = _TID_GUARD.search(body)
    assert guard, "no thread-0 guard"
    # One branch of the other threads around each call (the thread index is read once and reused).
    assert body.count(f"@{guard.group(2)} bra") == 3


def test_pairing_accepts_the_verified_pair_and_refuses_the_known_bad_one(monkeypatch):
    monkeypatch.delenv(nb.ENV_UNVERIFIED, raising=False)
    assert "3.4.5" in nb.check_pairing("3.6.0", "3.4.5")
    with pytest.raises(nb.NvshmemSetupError, match="cannot parse NVSHMEM 3.8"):
        nb.check_pairing("3.6.0", "3.8.0")
    with pytest.raises(nb.NvshmemSetupError, match="not been verified"):
        nb.check_pairing("3.6.0", "3.5.1")
    assert "3.4.5" in nb.check_pairing("3.9.0", "3.4.5")
    with pytest.raises(nb.NvshmemSetupError, match="not been verified: it compiles and links, but"):
        nb.check_pairing("3.9.0", "3.7.2")   # torch 2.15.0's pin: refused with the reason
    monkeypatch.setenv(nb.ENV_UNVERIFIED, "1")
    assert "unverified" in nb.check_pairing("3.6.0", "3.5.1")
    with pytest.raises(nb.NvshmemSetupError, match="cannot parse"):  # the override never admits a known-bad pair
        nb.check_pairing("3.6.0", "3.8.0")


def test_bitcode_lookup_honours_the_override_and_says_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv(nb.ENV_BITCODE, str(tmp_path / "missing.bc"))
    with pytest.raises(nb.NvshmemSetupError, match="is not a file"):
        nb.bitcode_path()
    f = tmp_path / "libnvshmem_device.bc"
    f.write_bytes(b"BC")
    monkeypatch.setenv(nb.ENV_BITCODE, str(f))
    assert nb.bitcode_path() == str(f)


def test_module_init_hook_joins_the_chain_and_only_touches_registered_kernels():
    calls = []

    def other(*args):
        calls.append(args[2])

    chain = triton.knobs.runtime.kernel_load_end_hook
    chain.add(other)
    try:
        nb.install_module_init_hook()
        nb.install_module_init_hook()  # idempotent
        assert chain.calls.count(nb._module_init) == 1 and other in chain.calls
        chain(object(), None, "some_other_kernel", {}, "h")   # not ours: nothing to initialize
        assert calls == ["some_other_kernel"]
        nb.register_kernel("a_kernel_with_puts")
        try:
            import nvshmem.core  # noqa: F401
        except ImportError:
            with pytest.raises(nb.NvshmemSetupError, match="module_init"):
                chain(object(), None, "a_kernel_with_puts", {}, "h")
    finally:
        chain.remove(other)
        chain.remove(nb._module_init)
        nb._hook_installed = False
        nb._kernel_names.discard("a_kernel_with_puts")
