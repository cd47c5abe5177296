"""LoRA in the kernels, by job: the executor a step's layers call (executor.py: one class per kernel backend), the
Triton kernels (triton_kernels.py) and how they launch (launch.py), a step's segments (segments.py), each kernel
family's layout choices (family.py) and the torch reference (reference.py)."""
