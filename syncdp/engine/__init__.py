"""The reduction engine: plan buckets, pack, reduce, unpack, in one place.

    buckets   which tensors go together, in launch order (small first bucket, then capped)
    buffers   aligned offsets for each member, and buffers reused between steps
    steps     every rank's training step, carried inside the first gradient bucket
    reducer   one bucket over all ranks: MPI in place for float32/64 and integers, bytes plus
              NumPy arithmetic for float16/bfloat16; results as views of the buffer
    joining   join(): a rank out of data stands in for the others' reductions until all join

Pure NumPy over :class:`syncdp.transport.communicator.Communicator`: the TensorFlow face adapts
tensors to it, and nothing here imports TensorFlow.
"""

from syncdp.engine.buckets import Bucket, TensorSpec, plan
from syncdp.engine.reducer import OPS, BucketReducer, broadcast_bucket, is_half

__all__ = ["Bucket", "TensorSpec", "plan", "BucketReducer", "broadcast_bucket", "OPS", "is_half"]
