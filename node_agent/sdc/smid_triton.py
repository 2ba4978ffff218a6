"""The Triton kernel that records ``%smid`` per program (block) for ``node_agent.sdc.coverage``.

Imported only when coverage is measured on a CUDA GPU and Triton is installed (Triton resolves
a kernel's names from its module's globals, so the kernel lives at module level here).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def record_smid(out_ptr, spin_ns):  # type: ignore[no-untyped-def]  # Triton reads the annotations
    """Each program spins ``spin_ns`` on ``%globaltimer`` (so programs overlap as a GEMM's
    CTAs do), then stores the ``%smid`` of the SM it ran on at ``out_ptr[program_id]``."""
    pid = tl.program_id(0)
    t0 = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False, pack=1
    )
    t = t0
    while t - t0 < spin_ns:
        t = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False, pack=1
        )
    sm = tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32, is_pure=False, pack=1
    )
    tl.store(out_ptr + pid, sm)
