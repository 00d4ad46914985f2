"""The one exception type that the CLI turns into a one-line message and exit code 1."""


class MtrainError(Exception):
    """A user-facing error: the message names the problem (file, line) and the fix.

    The CLI prints ``error: <message>`` on stderr and exits with code 1, with no traceback.
    Raise it for anything a user can fix (bad input, bad config); let real bugs propagate.
    """


def first_line(err: BaseException) -> str:
    """The first line of err's message (PyTorch's run on with notes and C++ frames), or its type's
    name when it has none: what a one-line error quotes of the exception behind it."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# Messages of the out-of-memory errors that do not arrive as torch.OutOfMemoryError: a CUDA
# allocation that fails inside a library (cuBLAS, cuDNN) or as a sticky "CUDA error", and the CPU
# allocator's failure, which PyTorch raises as a plain RuntimeError.
_OUT_OF_MEMORY_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
                           "can't allocate memory")


def is_out_of_memory(err: BaseException) -> bool:
    """Whether err says a device (or the host) ran out of memory. torch.OutOfMemoryError (2.5 on)
    is torch.cuda.OutOfMemoryError, a RuntimeError, so the message test covers torch 2.4 as well."""
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _OUT_OF_MEMORY_MESSAGES)


# How a collective reports that another rank of the job is gone. gloo sees the peer's socket close
# (or a write to it fail); NCCL, when it notices at all, reports the remote side's failure or a
# communicator aborted because of it. Other NCCL errors (a bad setup, a duplicate GPU) are not this.
_LOST_PEER_MESSAGES = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing",
                       "Broken pipe", "Socket closed", "ncclRemoteError", "remote process exited",
                       "communicator was aborted")


def is_lost_peer(err: BaseException) -> bool:
    """Whether err is a collective failing because another rank of the job stopped."""
    return isinstance(err, RuntimeError) and any(m in str(err) for m in _LOST_PEER_MESSAGES)
