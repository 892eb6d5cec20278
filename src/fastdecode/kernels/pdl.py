"""Programmatic dependent launch (PDL, sm_90+): the next kernel of a stream is scheduled while this one drains.

A kernel launched with ``launch_pdl=True`` may start before the previous kernel of its stream has finished
(before or after CUDA-graph capture: the launch attribute becomes a programmatic edge of the graph). Its
contract, kept by every kernel here that takes ``USE_PDL``:

* before ``pdl_wait()`` it reads only tensors that no kernel of the step writes (weights: the first weight
  tile of a GEMV is loaded there, which is what PDL is for) and writes nothing;
* ``pdl_wait()`` (``griddepcontrol.wait``) blocks until the previous kernel has completed and its memory is
  visible, then ``griddepcontrol.launch_dependents`` lets the next PDL kernel be scheduled. Placed after the
  wait, at most two grids of a stream are in flight, and each kernel completes only after the one before
  it (transitively, after every earlier kernel).

A kernel that does not take part (cuBLAS, PyTorch's own) is ordered as usual before and after. The policy
(on or off, per device) is ``fastdecode.ops._common.pdl_enabled``; kernels only obey ``USE_PDL``.
"""

import triton
import triton.language as tl


@triton.jit
def pdl_wait():
    """Wait for the previous kernel of the stream (and its memory), then let the next one be scheduled."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


def launch_kwargs(pdl: bool) -> dict:
    """The launch option of a PDL launch (the interpreter's launcher knows no ``launch_pdl``: {} when off)."""
    return {"launch_pdl": True} if pdl else {}
