"""The last rank executes an instruction its CPU does not have (x86's ud2, 0F 0B, which no CPU has; aarch64's
udf #0): the kernel kills it with SIGILL, as it kills a kernel built for AVX-512 on a CPU without it.

torchrun --nproc_per_node 2 illegal_instruction.py
"""
import ctypes
import mmap
import os
import platform

INVALID = b"\x00\x00\x00\x00" if platform.machine() in ("aarch64", "arm64") else b"\x0f\x0b"


def reduce_with_wide_vectors():
    code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    code.write(INVALID)
    ctypes.CFUNCTYPE(None)(ctypes.addressof(ctypes.c_char.from_buffer(code)))()


if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
    reduce_with_wide_vectors()
print("done")
