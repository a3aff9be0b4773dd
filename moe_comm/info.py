"""``python -m moe_comm info``: what this machine offers moe-comm, and for what is missing, why and the fix.

Reports versions, devices, which symmetric heaps and transports work here, and the NVSHMEM pieces (host
library, device bitcode, whether the installed Triton is known to read that bitcode). Reading it
changes nothing: no heap is created, no kernel runs, no environment variable is set.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import sysconfig

import torch

# Distributions whose versions matter to moe-comm (name as pip knows it; first installed one wins).
PACKAGES = {
    "torch": ("torch",),
    "triton": ("triton",),
    "numpy": ("numpy",),
    "nvshmem4py": ("nvshmem4py-cu13", "nvshmem4py-cu12"),
    "nvidia-nvshmem": ("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12"),
    "cuda-core": ("cuda-core", "cuda_core"),
    "vllm": ("vllm",),
    "sglang": ("sglang",),
}
NVSHMEM_FIX = "pip install 'moe-comm[nvshmem]' (nvshmem4py and cuda-core; they bring NVSHMEM's host library)"
BITCODE_FIX = "pip install nvidia-nvshmem-cu13 (or -cu12), or set NVSHMEM_LIB_DIR to the folder holding it"
# (Triton major.minor, NVSHMEM major.minor) pairs known to work: Triton 3.6 compiles kernels with NVSHMEM
# 3.4's device bitcode linked (checked on CPU by compiling for sm_90; torch 2.11-2.14 pin NVSHMEM 3.4.5).
KNOWN_BITCODE_PAIRS = {("3.6", "3.4")}


def _version(names) -> str | None:
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _major_minor(v: str | None) -> str | None:
    return None if v is None else ".".join(v.split("+")[0].split(".")[:2])


def versions() -> dict:
    from . import __version__  # noqa: PLC0415
    out = {"moe_comm": __version__, "python": platform.python_version()}
    out.update({k: _version(v) for k, v in PACKAGES.items()})
    out["torch_cuda"] = torch.version.cuda
    return out


def devices() -> dict:
    cuda = torch.cuda.is_available()
    gpus = []
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name, "arch": f"sm_{p.major}{p.minor}",
                         "memory_gib": round(p.total_memory / 2**30, 1)})
    if cuda:
        why = None
    elif torch.version.cuda is None:
        why = "this torch is a CPU build"
    else:
        why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    force = os.environ.get("MOE_COMM_INTERPRET", "0") == "1"
    return {"cuda": cuda, "gpus": gpus, "cuda_missing_reason": why, "cpu_cores": os.cpu_count(),
            "interpreter": ("every launch (MOE_COMM_INTERPRET=1)" if force else
                            "launches on CPU tensors (Triton's interpreter, per launch; CUDA tensors compile)")}


def _nvshmem_python() -> tuple[bool, str]:
    """Can nvshmem4py and cuda-core be imported (what backend='nvshmem' needs on the host side)?"""
    missing = [m for m in ("nvshmem", "cuda.core") if _find_spec(m) is None]
    if missing:
        return False, f"{' and '.join(missing)} not installed: {NVSHMEM_FIX}"
    try:
        import nvshmem.core  # noqa: F401, PLC0415
    except Exception as e:  # noqa: BLE001  (a broken install raises anything)
        return False, f"nvshmem.core failed to import ({type(e).__name__}: {e})"
    return True, "nvshmem4py imports"


def _find_spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def heaps(dev: dict | None = None) -> dict:
    dev = devices() if dev is None else dev
    shm_ok = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    nv_py, nv_why = _nvshmem_python()
    if not dev["cuda"]:
        nv = (False, f"needs a CUDA device ({dev['cuda_missing_reason']}); use backend='shm' or 'loopback'")
    elif not nv_py:
        nv = (False, nv_why)
    else:
        nv = (True, "GPU ranks, one process per GPU (torchrun or moe_comm.launch)")
    return {
        "loopback": {"usable": True, "what": "every rank in one process (tests, single-GPU benchmarks), on "
                     + ("the GPU or the CPU" if dev["cuda"] else "the CPU")},
        "shm": {"usable": shm_ok, "what": "CPU ranks in separate processes over /dev/shm" if shm_ok else
                "/dev/shm is missing or not writable"},
        "nvshmem": {"usable": nv[0], "what": nv[1]},
    }


def transports(heap_info: dict) -> dict:
    return {
        "store": {"usable": any(h["usable"] for h in heap_info.values()),
                  "what": "plain stores through peer pointers: one process (loopback), shared memory (shm), "
                          "GPUs that NVSHMEM maps into each other (one NVLink domain)"},
        "put": {"usable": False, "what": "NVSHMEM device puts to peers that are not load/store reachable "
                                         "(other nodes): not provided by this version"},
    }


def _search_dirs() -> list[str]:
    dirs = []
    if os.environ.get("NVSHMEM_LIB_DIR"):
        dirs.append(os.environ["NVSHMEM_LIB_DIR"])
    if os.environ.get("NVSHMEM_HOME"):
        dirs.append(os.path.join(os.environ["NVSHMEM_HOME"], "lib"))
    for key in ("purelib", "platlib"):
        d = os.path.join(sysconfig.get_path(key), "nvidia", "nvshmem", "lib")
        if d not in dirs:
            dirs.append(d)
    dirs += ["/usr/local/lib", "/usr/lib", "/usr/lib/x86_64-linux-gnu", "/opt/nvidia/nvshmem/lib"]
    return dirs


def _first(pattern: str, dirs) -> str | None:
    for d in dirs:
        hits = sorted(glob.glob(os.path.join(d, pattern)))
        if hits:
            return hits[0]
    return None


def _wheel_version_of(path: str) -> str | None:
    """NVSHMEM version of a file inside an nvidia-nvshmem wheel (<site>/nvidia/nvshmem/lib/<file>)."""
    site = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(path)))))
    hits = sorted(glob.glob(os.path.join(site, "nvidia_nvshmem_cu*-*.dist-info")))
    return os.path.basename(hits[-1]).split("-")[1] if hits else None


def nvshmem(vers: dict | None = None) -> dict:
    """NVSHMEM host library, device bitcode, and the Triton/bitcode pairing."""
    vers = versions() if vers is None else vers
    dirs = _search_dirs()
    py_ok, py_why = _nvshmem_python()
    host = _first("libnvshmem_host.so*", dirs)
    bitcode = _first("libnvshmem_device*.bc", dirs)
    bitcode_via = "search of " + ", ".join(dirs)
    if bitcode is None and py_ok:
        try:  # nvshmem4py knows its own wheel's layout (per-architecture files from NVSHMEM 3.7)
            import nvshmem.core as nv  # noqa: PLC0415
            found = nv.find_device_bitcode_library()
            bitcode, bitcode_via = (str(found), "nvshmem.core.find_device_bitcode_library()") if found else \
                (None, bitcode_via)
        except Exception:  # noqa: BLE001, S110  (older nvshmem4py: keep the directory search's answer)
            pass
    nv_version = vers["nvidia-nvshmem"] or (_wheel_version_of(bitcode) if bitcode else None)
    pair = (_major_minor(vers["triton"]), _major_minor(nv_version))
    if bitcode is None:
        pairing = "not checked: no NVSHMEM device bitcode"
    elif pair[1] is None:
        pairing = "not checked: the bitcode's NVSHMEM version is unknown (not from a pip wheel)"
    elif pair in KNOWN_BITCODE_PAIRS:
        pairing = f"Triton {pair[0]} with NVSHMEM {pair[1]}: known to work"
    else:
        pairing = (f"Triton {pair[0]} with NVSHMEM {pair[1]}: untested pair (known to work: "
                   + ", ".join(f"Triton {t} + NVSHMEM {n}" for t, n in sorted(KNOWN_BITCODE_PAIRS)) + ")")
    return {
        "python_bindings": {"found": py_ok, "detail": py_why},
        "host_library": {"found": host is not None,
                         "detail": host or f"libnvshmem_host.so not found in {', '.join(dirs)}: {NVSHMEM_FIX}"},
        "device_bitcode": {"found": bitcode is not None,
                           "detail": (f"{bitcode} (via {bitcode_via})" if bitcode else
                                      f"libnvshmem_device*.bc not found ({bitcode_via}): {BITCODE_FIX}"),
                           "needed": "no: this version's kernels reach peers by load/store only"},
        "triton_pairing": pairing,
    }


def collect() -> dict:
    vers, dev = versions(), devices()
    h = heaps(dev)
    return {"versions": vers, "devices": dev, "heaps": h, "transports": transports(h), "nvshmem": nvshmem(vers)}


def _yes(ok: bool) -> str:
    return "yes" if ok else "no "


def render(info: dict) -> str:
    v, d = info["versions"], info["devices"]
    lines = [f"moe-comm {v['moe_comm']} (python {v['python']})", "", "versions"]
    for k in PACKAGES:
        extra = f" (CUDA {v['torch_cuda']})" if k == "torch" and v["torch_cuda"] else \
            " (CPU build)" if k == "torch" else ""
        lines.append(f"  {k:<15}{(v[k] or 'not installed') + extra}")
    lines += ["", "devices"]
    if d["cuda"]:
        lines += [f"  cuda:{g['index']:<10}{g['name']}, {g['arch']}, {g['memory_gib']} GiB" for g in d["gpus"]]
    else:
        lines.append(f"  CUDA           none: {d['cuda_missing_reason']}")
    lines += [f"  CPU            {d['cpu_cores']} cores", f"  interpreter    {d['interpreter']}", "", "heaps"]
    lines += [f"  {k:<10}{_yes(h['usable'])}  {h['what']}" for k, h in info["heaps"].items()]
    lines += ["", "transports"]
    lines += [f"  {k:<10}{_yes(t['usable'])}  {t['what']}" for k, t in info["transports"].items()]
    n = info["nvshmem"]
    lines += ["", "NVSHMEM",
              f"  python bindings  {_yes(n['python_bindings']['found'])}  {n['python_bindings']['detail']}",
              f"  host library     {_yes(n['host_library']['found'])}  {n['host_library']['detail']}",
              f"  device bitcode   {_yes(n['device_bitcode']['found'])}  {n['device_bitcode']['detail']}",
              f"                        needed: {n['device_bitcode']['needed']}",
              f"  Triton pairing   {n['triton_pairing']}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse  # noqa: PLC0415
    ap = argparse.ArgumentParser(prog="moe-comm info", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=1) if args.json else render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
