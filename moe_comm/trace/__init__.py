"""Flight recorder: per-channel rings of the last calls, written by the kernels (``layout.py``: the
words; ``recorder.py``: turning it on, dumping a rank's rings; ``analyze.py``: merging the ranks' dumps
into a diagnosis and a Chrome trace; ``python -m moe_comm trace DIR``). Device side:
``moe_comm/triton_kernels/trace.py``."""
