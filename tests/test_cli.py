"""``python -m moe_comm info`` / ``selftest`` and the ``moe-comm`` command."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import triton

import moe_comm
from moe_comm import __main__ as cli
from moe_comm import info, selftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, env=None):
    e = {k: v for k, v in os.environ.items() if k not in ("NVSHMEM_LIB_DIR", "NVSHMEM_HOME")}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "moe_comm", *args], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=300)


def test_info_json_matches_this_machine():
    out = _run("info", "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["versions"]["moe_comm"] == moe_comm.__version__
    public = lambda v: v.split("+")[0]   # noqa: E731  (the wheel's metadata may omit torch's local tag, +cu132)
    assert public(r["versions"]["torch"]) == public(torch.__version__) and r["versions"]["triton"] == triton.__version__
    assert r["devices"]["cuda"] == torch.cuda.is_available()
    assert len(r["devices"]["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert r["heaps"]["loopback"]["usable"] and r["transports"]["store"]["usable"]
    if not torch.cuda.is_available():
        assert not r["heaps"]["nvshmem"]["usable"] and "CUDA" in r["heaps"]["nvshmem"]["what"]
        assert r["devices"]["cuda_missing_reason"]
    for part in ("host_library", "device_bitcode"):
        entry = r["nvshmem"][part]
        assert entry["found"] or "pip install" in entry["detail"], entry   # missing: the fix is named


def test_info_text_names_every_section():
    text = info.render(info.collect())
    for section in ("\nversions\n", "\ndevices\n", "\nheaps\n", "\ntransports\n", "\nNVSHMEM\n", "Triton pairing",
                    "\ntracing\n"):
        assert section in text, section


def test_info_says_whether_tracing_is_on(monkeypatch, tmp_path):
    monkeypatch.delenv("MOE_COMM_TRACE", raising=False)
    monkeypatch.delenv("MOE_COMM_TRACE_DIR", raising=False)
    t = info.collect()["tracing"]
    assert (t["on"], t["calls"], t["dump_dir"]) == (False, 0, None)
    assert "off (set MOE_COMM_TRACE=1" in info.render(info.collect())
    assert info.collect()["metrics"]["available"]   # the test extra installs prometheus-client
    assert "metrics          prometheus_client " in info.render(info.collect())
    monkeypatch.setenv("MOE_COMM_TRACE", "16")
    monkeypatch.setenv("MOE_COMM_TRACE_DIR", str(tmp_path))
    t = info.collect()["tracing"]
    assert (t["on"], t["calls"], t["dump_dir"]) == (True, 16, str(tmp_path))
    assert f"on: the last 16 calls per channel (MOE_COMM_TRACE=16); GroupError dumps to {tmp_path}" in info.render(
        info.collect())
    monkeypatch.setenv("MOE_COMM_TRACE", "lots")
    assert "number of calls to keep" in info.collect()["tracing"]["detail"]


def test_info_says_surviving_a_lost_node_needs_ibgda(monkeypatch):
    """docs/faults.md: survival of a rank lost on another node holds under NVSHMEM's IBGDA transport only;
    ``info`` says which one the environment selects and what survives under it."""
    monkeypatch.delenv(info.IBGDA_ENV, raising=False)
    monkeypatch.delenv(info.REMOTE_ENV, raising=False)
    r = info.collect()["nvshmem"]["remote_transport"]
    assert not r["ibgda"] and "ibrc" in r["name"] and "needs IBGDA (NVSHMEM_IB_ENABLE_IBGDA=1)" in r["survival"]
    assert "remote transport ibrc (NVSHMEM's CPU proxy" in info.render(info.collect())
    monkeypatch.setenv(info.IBGDA_ENV, "1")
    r = info.collect()["nvshmem"]["remote_transport"]
    assert r["ibgda"] and "exclude() it and keep serving" in r["survival"]


def test_info_finds_bitcode_and_pairs_versions(tmp_path, monkeypatch):
    """A wheel-shaped folder (site/nvidia/nvshmem/lib + the dist-info) pointed at by NVSHMEM_LIB_DIR, the
    only place searched (no installed wheel)."""
    from moe_comm.triton_kernels import nvshmem_bitcode as nb
    lib = tmp_path / "site" / "nvidia" / "nvshmem" / "lib"
    lib.mkdir(parents=True)
    monkeypatch.setenv("NVSHMEM_LIB_DIR", str(lib))
    monkeypatch.delenv(nb.ENV_BITCODE, raising=False)
    monkeypatch.setattr(nb, "search_dirs", lambda: [str(lib)])
    monkeypatch.setattr(nb, "WHEELS", ())
    monkeypatch.setitem(sys.modules, "nvshmem", None)   # no nvshmem4py either
    no_wheel = dict(info.versions(), **{"nvidia-nvshmem": None, "triton": "3.6.0"})
    n = info.nvshmem(no_wheel)
    assert not n["device_bitcode"]["found"] and "NVSHMEM_LIB_DIR" in n["device_bitcode"]["detail"]
    assert n["triton_pairing"].startswith("not checked")
    (lib / "libnvshmem_device.bc").write_bytes(b"BC")
    (lib / "libnvshmem_host.so.3").write_bytes(b"")
    n = info.nvshmem(no_wheel)
    assert n["device_bitcode"]["found"] and n["device_bitcode"]["detail"] == str(lib / "libnvshmem_device.bc")
    assert n["host_library"]["found"] and n["host_library"]["detail"] == str(lib / "libnvshmem_host.so.3")
    assert "unknown" in n["triton_pairing"]
    (tmp_path / "site" / "nvidia_nvshmem_cu13-3.4.5.dist-info").mkdir()
    n = info.nvshmem(no_wheel)
    assert n["triton_pairing"].startswith("Triton 3.6.0 + NVSHMEM 3.4.5: compiles and links"), n["triton_pairing"]
    n = info.nvshmem(dict(no_wheel, **{"nvidia-nvshmem": "3.9.1"}))
    assert "has not been verified" in n["triton_pairing"]
    n = info.nvshmem(dict(no_wheel, **{"nvidia-nvshmem": "3.8.0"}))
    assert "cannot parse" in n["triton_pairing"]


@pytest.mark.timeout(300)
def test_selftest_command_passes_here():
    """The installed ``moe-comm`` command (pyproject [project.scripts]) runs the self-test."""
    script = os.path.join(os.path.dirname(sys.executable), "moe-comm")
    assert os.path.exists(script), "the moe-comm console script is not installed (pip install -e .)"
    out = subprocess.run([script, "selftest", "--device", "cpu"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(selftest.CHECKS) + len(selftest.PROCESS_CHECKS)} passed, 0 failed" in out.stdout, out.stdout
    assert re.search(r"PASS  cpu, shm world 2 +AllToAllvDynamic and EPBuffer, one process per rank", out.stdout)


def test_selftest_fails_on_a_wrong_result(monkeypatch, capsys):
    """A combine that returns wrong values and an AllToAllvDynamic that raises: both reported, exit 1."""
    from moe_comm.alltoallv import AllToAllvDynamic
    from moe_comm.ep import EPBuffer
    real = EPBuffer.combine

    def wrong(self, *a, **kw):
        y = real(self, *a, **kw)
        return None if y is None else y + 1

    def broken(self, *a, **kw):
        raise RuntimeError("injected")

    monkeypatch.setattr(EPBuffer, "combine", wrong)
    monkeypatch.setattr(AllToAllvDynamic, "__call__", broken)
    monkeypatch.setattr(selftest, "targets", lambda: [("cpu", 2, selftest.LOOPBACK)])  # patches reach this process only
    assert selftest.main(["--device", "cpu"]) == 1
    text = capsys.readouterr().out
    assert text.count("FAIL") == 3 and "injected" in text and "combine differs" in text, text
    assert "1 passed, 3 failed" in text


def test_command_usage_and_errors(capsys):
    assert cli.main([]) == 2 and "usage: moe-comm" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
    assert cli.main(["bogus"]) == 2 and "unknown command 'bogus'" in capsys.readouterr().err
