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
                            "launches on CPU tensors (Triton's interpreter, per launch; CUDA tensors compile)"),
            "triton_interpret": triton_interpret(cuda)}


def triton_interpret(cuda: bool) -> str:
    """What the user's TRITON_INTERPRET setting means for moe-comm here (as Triton itself reads it)."""
    import triton  # noqa: PLC0415
    if not triton.knobs.runtime.interpret:
        return "off"
    return (f"on (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}): on CPU tensors moe-comm's ops run "
            "as without it (their own interpreted copies); " +
            ("CUDA tensors cannot: unset it to run the compiled kernels" if cuda else
             "there is no CUDA device here, so nothing changes"))


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
        "put": {"usable": any(h["usable"] for h in heap_info.values()),
                "what": "NVSHMEM device puts, for peers NVSHMEM cannot map (other nodes; MOE_COMM_TRANSPORT=put "
                        "forces them): on the CPU as plain copies, or messages between emulated nodes "
                        "(MOE_COMM_RANKS_PER_NODE); on GPUs they need the device bitcode and a verified Triton "
                        "pairing, and survival of a lost node needs IBGDA (NVSHMEM, below)"},
    }


def _first(pattern: str, dirs) -> str | None:
    for d in dirs:
        hits = sorted(glob.glob(os.path.join(d, pattern)))
        if hits:
            return hits[0]
    return None


def nvshmem(vers: dict | None = None) -> dict:
    """NVSHMEM host library, device bitcode, and the Triton/bitcode pairing (the checks the put
    transport's kernels make: ``triton_kernels/nvshmem_bitcode.py``)."""
    from .triton_kernels import nvshmem_bitcode as nb  # noqa: PLC0415
    vers = versions() if vers is None else vers
    dirs = nb.search_dirs()
    py_ok, py_why = _nvshmem_python()
    host = _first("libnvshmem_host.so*", dirs)
    try:
        bitcode, bitcode_detail = nb.bitcode_path(), None
    except nb.NvshmemSetupError as e:
        bitcode, bitcode_detail = None, str(e)
    nv_version = vers["nvidia-nvshmem"] or (nb.nvshmem_version(bitcode) if bitcode else None)
    if bitcode is None:
        pairing = "not checked: no NVSHMEM device bitcode"
    elif nv_version is None:
        pairing = "not checked: the bitcode's NVSHMEM version is unknown (not from a pip wheel)"
    else:
        try:
            pairing = nb.check_pairing(vers["triton"], nv_version)
        except nb.NvshmemSetupError as e:
            pairing = str(e)
    return {
        "python_bindings": {"found": py_ok, "detail": py_why},
        "host_library": {"found": host is not None,
                         "detail": host or f"libnvshmem_host.so not found in {', '.join(dirs)}: {NVSHMEM_FIX}"},
        "device_bitcode": {"found": bitcode is not None, "detail": bitcode or bitcode_detail,
                           "needed": "for the put transport's kernels on a GPU (MOE_COMM_TRANSPORT=put, or "
                                     "peers NVSHMEM cannot map)"},
        "triton_pairing": pairing,
        "remote_transport": remote_transport(),
    }


IBGDA_ENV = "NVSHMEM_IB_ENABLE_IBGDA"          # NVSHMEM's switch to its GPU-initiated InfiniBand transport
REMOTE_ENV = "NVSHMEM_REMOTE_TRANSPORT"        # its network transport otherwise (default ibrc: a CPU proxy)


def remote_transport() -> dict:
    """The NVSHMEM network transport this environment selects, and what survives a rank lost on another
    node under it (docs/faults.md, "A dead peer across nodes"): the put path never waits for a put's
    completion, so with IBGDA nothing looks at the dead rank's failed puts and the survivors name, exclude
    and go on; NVSHMEM's proxy transports poll every completion and end the process at a failed one."""
    ibgda = os.environ.get(IBGDA_ENV, "").strip().lower() in ("1", "true", "yes", "y", "on")
    if ibgda:
        return {"ibgda": True, "name": f"IBGDA ({IBGDA_ENV}=1)",
                "survival": "a rank lost on another node is named by every survivor (CommTimeoutError), which "
                            "exclude() it and keep serving, as long as the puts posted to it fit one send queue "
                            "(NVSHMEM_QP_DEPTH; a prefill call of a few hundred tokens to its node fills it: "
                            "docs/faults.md)"}
    name = os.environ.get(REMOTE_ENV, "").strip().lower() or "ibrc"
    return {"ibgda": False, "name": f"{name} (NVSHMEM's CPU proxy; {IBGDA_ENV} is not set)",
            "survival": f"a rank lost on another node ends every rank that put to it once the NIC gives up "
                        f"(about 34 s): surviving it needs IBGDA ({IBGDA_ENV}=1)"}


def collect() -> dict:
    vers, dev = versions(), devices()
    h = heaps(dev)
    from .metrics import status as metrics_status  # noqa: PLC0415
    from .trace.recorder import status  # noqa: PLC0415
    return {"versions": vers, "devices": dev, "heaps": h, "transports": transports(h), "nvshmem": nvshmem(vers),
            "tracing": status(), "metrics": metrics_status()}


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
    lines += [f"  CPU            {d['cpu_cores']} cores", f"  interpreter    {d['interpreter']}",
              f"  TRITON_INTERPRET {d['triton_interpret']}", "", "heaps"]
    lines += [f"  {k:<10}{_yes(h['usable'])}  {h['what']}" for k, h in info["heaps"].items()]
    lines += ["", "transports"]
    lines += [f"  {k:<10}{_yes(t['usable'])}  {t['what']}" for k, t in info["transports"].items()]
    n = info["nvshmem"]
    lines += ["", "NVSHMEM",
              f"  python bindings  {_yes(n['python_bindings']['found'])}  {n['python_bindings']['detail']}",
              f"  host library     {_yes(n['host_library']['found'])}  {n['host_library']['detail']}",
              f"  device bitcode   {_yes(n['device_bitcode']['found'])}  {n['device_bitcode']['detail']}",
              f"                        needed: {n['device_bitcode']['needed']}",
              f"  Triton pairing   {n['triton_pairing']}",
              f"  remote transport {n['remote_transport']['name']}: {n['remote_transport']['survival']}",
              "", "tracing", f"  flight recorder  {info['tracing']['detail']}",
              f"  metrics          {info['metrics']['detail']} (docs/metrics.md)"]
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
