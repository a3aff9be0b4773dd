"""The README's integration snippets run as written (each door's snippet is extracted from README.md)."""

import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def snippet(heading: str) -> str:
    """The first ```python block after the README heading that starts with ``heading``."""
    text = README.read_text()
    start = text.index(heading)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_deep_ep_door_snippet_runs_under_torchrun(tmp_path):
    code = snippet("### Code written for DeepEP")
    assert "from moe_comm.compat import deep_ep" in code
    path = tmp_path / "deep_ep_door.py"
    path.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--standalone", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    finally:  # torchrun's workers too, whatever happened
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    lines = re.findall(r"rank (\d): \[[\d, ]+\] rows per local expert; combine within ([\d.]+)% \(fp8\)", stdout)
    assert sorted(r for r, _ in lines) == ["0", "1"], stdout
    assert all(float(e) < 10 for _, e in lines), lines   # fp8 round trip of identity experts


def _body(path: pathlib.Path) -> str:
    """A snippet file without its leading comment lines (what the README shows)."""
    lines = path.read_text().splitlines()
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "\n".join(lines).strip() + "\n"


@pytest.mark.parametrize("door,path", [("**vLLM**", "tests/vllm/readme_snippet.py"),
                                       ("**SGLang**", "tests/sglang/readme_snippet.py")])
def test_serving_snippets_are_the_files_their_suites_run(door, path):
    """The vLLM and SGLang snippets need their frameworks (make test-vllm / make test-sglang run the
    files); here: the README shows exactly those files."""
    assert snippet(door) == _body(README.parent / path)
