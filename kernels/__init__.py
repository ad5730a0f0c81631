"""GPU kernels (Triton) with torch reference implementations; installed as ``rlhf_mcore.kernels``.

Each kernel module exposes a reference function that runs anywhere and a Triton path used on CUDA (or under
``TRITON_INTERPRET=1`` on CPU in tests).
"""
