"""Every ```python block of README.md and docs/*.md runs and checks its own result, or says why not.

A block is run as a script (in a fresh process) unless the line before it is an HTML comment:
``<!-- not run: <why> -->`` (it needs a GPU or a framework), or ``<!-- run by: tests/<file>::<test> -->``
(a test here runs it another way, e.g. under torchrun). A block that runs must check what it computes
(an ``assert``), so a wrong result fails the test, not only an exception.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!--\s*(not run|run by):\s*(.*?)\s*-->\n)?```python\n(.*?)```", re.S)
SNIPPET_TIMEOUT_S = 600   # torch.compile's first compile on a loaded 2-core CPU


def python_blocks(path: pathlib.Path) -> list[tuple[str, str, str, str]]:
    """(id, marker, reason, code) of every ```python block of ``path``; marker is "" for a block to run."""
    text = path.read_text()
    return [(f"{path.name}:{text.count(chr(10), 0, m.start(3))}", m.group(1) or "", m.group(2) or "", m.group(3))
            for m in BLOCK.finditer(text)]


BLOCKS = [b for p in DOCS for b in python_blocks(p)]


def _run_script(path: pathlib.Path, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``argv`` in its own session (its child processes are killed with it, whatever happens)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.Popen(argv, cwd=path.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.timeout(SNIPPET_TIMEOUT_S + 60)
@pytest.mark.parametrize("block_id, marker, reason, code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_every_python_block_runs_or_is_marked(block_id, marker, reason, code, tmp_path):
    if marker == "not run":
        assert len(reason) > 10, f"{block_id}: say why the block is not run"
        return
    if marker == "run by":
        file, _, name = reason.partition("::")
        assert (ROOT / file).is_file() and f"def {name}(" in (ROOT / file).read_text(), (block_id, reason)
        return
    assert "assert " in code, f"{block_id}: a block that runs must check its result (an assert)"
    script = tmp_path / "snippet.py"
    script.write_text(code)
    out = _run_script(script, [sys.executable, str(script)], SNIPPET_TIMEOUT_S)
    assert out.returncode == 0, f"{block_id}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert out.stdout.strip(), f"{block_id}: prints nothing a reader could check"


def test_blocks_are_found_and_every_file_is_read(tmp_path):
    """The parser finds the blocks this repository has (a broken pattern would pass every block)."""
    ids = [b[0] for b in BLOCKS]
    assert sum(i.startswith("README.md:") for i in ids) >= 2 and any(i.startswith("integrations.md:") for i in ids)
    probe = tmp_path / "probe.md"
    probe.write_text("x\n<!-- not run: a reason long enough -->\n```python\nprint(1)\n```\n```python\nassert 1\n```\n")
    assert [(m, c) for _, m, _, c in python_blocks(probe)] == [("not run", "print(1)\n"), ("", "assert 1\n")]


def snippet(path: pathlib.Path, heading: str) -> str:
    """The first ```python block after the heading of ``path`` that starts with ``heading``."""
    text = path.read_text()
    start = text.index(heading)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


INTEGRATIONS = ROOT / "docs" / "integrations.md"


@pytest.mark.timeout(240)
def test_deep_ep_door_snippet_runs_under_torchrun(tmp_path):
    code = snippet(INTEGRATIONS, "## Code written for DeepEP")
    assert "from moe_comm.compat import deep_ep" in code
    path = tmp_path / "deep_ep_door.py"
    path.write_text(code)
    out = _run_script(path, [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                             str(path)], 180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = re.findall(r"rank (\d): \[[\d, ]+\] rows per local expert; combine within ([\d.]+)% \(fp8\)", out.stdout)
    assert sorted(r for r, _ in lines) == ["0", "1"], out.stdout
    assert all(float(e) < 10 for _, e in lines), lines   # fp8 round trip of identity experts


def _body(path: pathlib.Path) -> str:
    """A snippet file without its leading comment lines (what the docs show)."""
    lines = path.read_text().splitlines()
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "\n".join(lines).strip() + "\n"


@pytest.mark.parametrize("door,path", [("**vLLM**", "tests/vllm/readme_snippet.py"),
                                       ("**SGLang**", "tests/sglang/readme_snippet.py")])
def test_serving_snippets_are_the_files_their_suites_run(door, path):
    """The vLLM and SGLang snippets need their frameworks (make test-vllm / make test-sglang run the
    files); here: the docs show exactly those files."""
    assert snippet(INTEGRATIONS, door) == _body(ROOT / path)


README_MAX_WORDS = 1500   # read in one sitting: the rest belongs in docs/


def test_readme_is_short_and_its_links_resolve():
    """README.md stays under README_MAX_WORDS (as `wc -w` counts) and every relative link names a file here."""
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= README_MAX_WORDS, f"README.md has {len(text.split())} words: move detail to docs/"
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text)
    assert links and [p for p in links if not (ROOT / p).exists()] == []
