"""Device code, one op per file (kernels, then launchers); ``sync`` holds the shared signalling.

These modules hold ``@triton.jit`` functions only (and small host launchers). Launch them through
``moe_comm.interpreter.kernel_for(kernel, device)``, which picks the compiled kernel for CUDA tensors and
its interpreted twin for CPU tensors. Compile configurations for the sm_90 check live in
``compile_report``, not here: importing a kernel module builds nothing.
"""
