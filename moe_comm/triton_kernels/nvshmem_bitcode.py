"""Host side of the NVSHMEM device binding: find the device bitcode, check that it pairs with the installed
Triton, and initialize every loaded module that calls NVSHMEM.

- ``bitcode_path(arch)``: ``MOE_COMM_NVSHMEM_BITCODE`` if set; else nvshmem4py's
  ``nvshmem.core.find_device_bitcode_library()``; else the ``nvidia-nvshmem-cu13``/``-cu12`` wheel's
  ``lib/`` (``libnvshmem_device.bc`` up to NVSHMEM 3.6, ``libnvshmem_device_sm_<arch>.bc`` from 3.7).
- ``check_pairing()``: the most common NVSHMEM failure is a version mismatch. Triton links the bitcode
  with its own LLVM, which must be able to read it: only pairs listed in ``VERIFIED`` are accepted (a
  pair known to fail, or not yet tried, raises ``NvshmemSetupError`` naming both versions and the fix;
  ``MOE_COMM_NVSHMEM_UNVERIFIED=1`` lets an untried pair through, never a known-bad one).
- ``launch_options(arch)``: the ``extern_libs`` a launch of a kernel with NVSHMEM calls needs.
- ``install_module_init_hook()``: NVSHMEM needs ``nvshmemx_cumodule_init`` on every loaded CUDA module
  that uses its device state, before the first launch. The hook joins Triton's
  ``knobs.runtime.kernel_load_end_hook`` chain (other users' hooks keep running) and initializes only
  modules of the kernels registered with ``register_kernel``.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import re

ENV_BITCODE = "MOE_COMM_NVSHMEM_BITCODE"
ENV_UNVERIFIED = "MOE_COMM_NVSHMEM_UNVERIFIED"
WHEELS = ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12")
LIB_NAME = "libnvshmem_device"        # extern_libs key

# (Triton major.minor, NVSHMEM major.minor): checked by compiling to sm_90 with the bitcode linked.
VERIFIED = {((3, 6), (3, 4)): "compiles and links (tests/test_nvshmem_compile.py)",
            ((3, 9), (3, 4)): "compiles and links; the put variants keep the sm_90 PTX rules (compile_report)"}
KNOWN_BAD = {((3, 6), (3, 8)): "Triton 3.6's LLVM cannot parse NVSHMEM 3.8's bitcode"}
# Pairs tried and not verified, and why: refused with this reason (MOE_COMM_NVSHMEM_UNVERIFIED=1 admits them).
NOT_VERIFIED = {((3, 9), (3, 7)): "it compiles and links, but the sm_90 PTX rule checks (ptx_rules.py) do not "
                                  "yet pass on NVSHMEM 3.7's own code (multi-line inline assembly, release stores "
                                  "in its proxy functions); install nvidia-nvshmem-cu13==3.4.5 for the put transport"}
SYSTEM_DIRS = ("/usr/local/lib", "/usr/lib", "/usr/lib/x86_64-linux-gnu", "/opt/nvidia/nvshmem/lib")


class NvshmemSetupError(RuntimeError):
    """NVSHMEM's device library is missing, or does not pair with the installed Triton."""


def _major_minor(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise NvshmemSetupError(f"cannot read a version from {version!r}")
    return int(m.group(1)), int(m.group(2))


def nvshmem_version(bitcode: str | None = None) -> str | None:
    """Version of the installed NVSHMEM wheel; else, for a ``bitcode`` file inside a wheel-shaped folder
    (``<site>/nvidia/nvshmem/lib/<file>`` next to ``nvidia_nvshmem_cu*-<version>.dist-info``), that
    version; else None."""
    for wheel in WHEELS:
        try:
            return importlib.metadata.version(wheel)
        except importlib.metadata.PackageNotFoundError:
            continue
    if bitcode is not None:
        site = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(bitcode)))))
        hits = sorted(glob.glob(os.path.join(site, "nvidia_nvshmem_cu*-*.dist-info")))
        if hits:
            return os.path.basename(hits[-1]).removesuffix(".dist-info").split("-")[1]
    return None


def _wheel_lib_dir() -> str | None:
    spec = importlib.util.find_spec("nvidia.nvshmem") if importlib.util.find_spec("nvidia") else None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "lib")


def search_dirs() -> list[str]:
    """Where NVSHMEM's libraries are looked for, in order: ``NVSHMEM_LIB_DIR``, ``$NVSHMEM_HOME/lib``, the
    pip wheel's folder, the usual system folders."""
    dirs = [os.environ[v] for v in ("NVSHMEM_LIB_DIR",) if os.environ.get(v)]
    if os.environ.get("NVSHMEM_HOME"):
        dirs.append(os.path.join(os.environ["NVSHMEM_HOME"], "lib"))
    wheel = _wheel_lib_dir()
    dirs += [wheel] if wheel else []
    return dirs + [d for d in SYSTEM_DIRS if d not in dirs]


def bitcode_path(arch: int = 90) -> str:
    """Path of NVSHMEM's device bitcode for ``sm_<arch>``: ``MOE_COMM_NVSHMEM_BITCODE``, else the first
    ``libnvshmem_device_sm_<arch>.bc`` / ``libnvshmem_device.bc`` in ``search_dirs()``, else what nvshmem4py
    finds. NvshmemSetupError (with the fix) if there is none."""
    env = os.environ.get(ENV_BITCODE)
    if env:
        if not os.path.isfile(env):
            raise NvshmemSetupError(f"{ENV_BITCODE}={env} is not a file")
        return env
    dirs, others = search_dirs(), []
    for d in dirs:
        for name in (f"{LIB_NAME}_sm_{arch}.bc", f"{LIB_NAME}.bc"):
            if os.path.isfile(os.path.join(d, name)):
                return os.path.join(d, name)
        others += sorted(glob.glob(os.path.join(d, f"{LIB_NAME}*.bc")))
    try:
        import nvshmem.core as nvc  # noqa: PLC0415  (optional: nvshmem4py)
        found = nvc.find_device_bitcode_library()
        if found and os.path.isfile(str(found)):
            return str(found)
    except (ImportError, AttributeError, TypeError, RuntimeError, OSError):
        pass
    if others:
        raise NvshmemSetupError(f"NVSHMEM's device bitcode for sm_{arch} was not found (found {others})")
    raise NvshmemSetupError(
        "NVSHMEM's device bitcode (libnvshmem_device*.bc) is not installed (searched " + ", ".join(dirs) +
        "): pip install --no-deps nvidia-nvshmem-cu13==3.4.5 (the version pinned in "
        f"requirements/constraints.txt), or set NVSHMEM_LIB_DIR to its folder or {ENV_BITCODE} to the file")


def check_pairing(triton_version: str | None = None, nvshmem: str | None = None) -> str:
    """Refuse an NVSHMEM bitcode that the installed Triton cannot link; returns a one-line summary."""
    if triton_version is None:
        import triton  # noqa: PLC0415
        triton_version = triton.__version__
    nvshmem = nvshmem or nvshmem_version()
    if nvshmem is None:
        raise NvshmemSetupError(f"cannot tell which NVSHMEM is installed (none of {WHEELS}); install "
                                f"nvidia-nvshmem-cu13==3.4.5")
    pair = (_major_minor(triton_version), _major_minor(nvshmem))
    if pair in KNOWN_BAD:
        raise NvshmemSetupError(f"Triton {triton_version} with NVSHMEM {nvshmem}: {KNOWN_BAD[pair]}. "
                                f"Install nvidia-nvshmem-cu13==3.4.5 (the pinned version)")
    if pair not in VERIFIED and os.environ.get(ENV_UNVERIFIED, "0") != "1":
        known = ", ".join(f"Triton {t[0]}.{t[1]} + NVSHMEM {n[0]}.{n[1]}" for t, n in VERIFIED)
        why = f": {NOT_VERIFIED[pair]}" if pair in NOT_VERIFIED else ""
        raise NvshmemSetupError(f"Triton {triton_version} with NVSHMEM {nvshmem} has not been verified{why} "
                                f"(verified: {known}); set {ENV_UNVERIFIED}=1 to try it anyway")
    status = VERIFIED.get(pair, f"unverified, allowed by {ENV_UNVERIFIED}")
    return f"Triton {triton_version} + NVSHMEM {nvshmem}: {status}"


def launch_options(arch: int = 90) -> dict:
    """Keyword arguments for launching (or ``triton.compile`` options for compiling) a kernel that makes
    NVSHMEM calls: the bitcode, after the pairing check."""
    check_pairing()
    return {"extern_libs": {LIB_NAME: bitcode_path(arch)}}


# ---- module init ------------------------------------------------------------------------------------
_kernel_names: set[str] = set()
_hook_installed = False


def register_kernel(name: str) -> None:
    """Kernels named here get ``nvshmemx_cumodule_init`` when Triton loads their module."""
    _kernel_names.add(name)


def _module_init(module, function, name, metadata_group, hash_) -> None:  # Triton's InitHandleHook
    if module is None or name not in _kernel_names:
        return
    try:
        import nvshmem.core as nvc  # noqa: PLC0415
        kernel_object = getattr(nvc, "NvshmemKernelObject")
        init = getattr(nvc, "module_init")
    except (ImportError, AttributeError) as e:
        raise NvshmemSetupError(f"kernel {name} calls NVSHMEM and needs nvshmem4py's module_init to load "
                                f"(pip install 'moe-comm[nvshmem]'): {e}") from e
    init(kernel_object.from_handle(module))


def install_module_init_hook() -> None:
    """Join Triton's kernel-load hook chain once (idempotent; other hooks in the chain are kept)."""
    global _hook_installed
    import triton  # noqa: PLC0415
    if not _hook_installed:
        triton.knobs.runtime.kernel_load_end_hook.add(_module_init)
        _hook_installed = True
