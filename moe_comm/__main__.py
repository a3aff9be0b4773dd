"""``python -m moe_comm`` (also the ``moe-comm`` command): ``info``, ``selftest``, ``trace``, ``warmup``, ``generate``.

    python -m moe_comm info [--json]      versions, devices, heaps and transports usable here, NVSHMEM
    python -m moe_comm selftest [--device cpu|cuda]   a short correctness run of every op (exit 1 on failure)
    python -m moe_comm trace DIR [--chrome PATH]     merge the ranks' flight-recorder dumps: diagnosis + timeline
    python -m moe_comm warmup [--model deepseek-v3 --world 8 ...]   compile a deployment's kernels into Triton's cache
    python -m moe_comm generate [--family qwen3_moe --world 2 ...]  a transformers MoE model generating through moe-comm
"""

from __future__ import annotations

import sys

COMMANDS = {
    "info": "what this machine offers moe-comm (versions, devices, heaps, transports, NVSHMEM), and fixes",
    "selftest": "a short correctness run of every op on this machine's devices; exit status 1 on failure",
    "trace": "merge the ranks' flight-recorder dumps in DIR: who never published, who waited, a timeline",
    "warmup": "compile every kernel variant a deployment launches into Triton's cache, before serving",
    "generate": "a tiny transformers MoE model generates on N ranks through moe-comm, beside transformers' own tokens",
}


def _usage() -> str:
    return "usage: moe-comm {info,selftest,trace,warmup,generate} [options]\n\n" + "\n".join(
        f"  {name:<10}{what}" for name, what in COMMANDS.items()) + "\n\n'moe-comm COMMAND --help' for its options"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "info":
        from .info import main as run  # noqa: PLC0415
    elif cmd == "selftest":
        from .selftest import main as run  # noqa: PLC0415
    elif cmd == "trace":
        from .trace.analyze import main as run  # noqa: PLC0415
    elif cmd == "warmup":
        from .warmup import main as run  # noqa: PLC0415
    elif cmd == "generate":
        from .serving.hf.generate import main as run  # noqa: PLC0415
    else:
        print(f"moe-comm: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
