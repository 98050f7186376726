"""Stand-in for sgl_kernel (PyPI `sglang-kernel` 0.4.10, pinned by SGLang 0.5.23): its only
published wheel links CUDA (libcuda.so.1, libnvrtc.so.13) and it has no source release.
SGLang's CPU engine imports it at start-up; its ops run only on CPUs with AMX (this
tier's torch_native attention backend calls none), so every op raises if called."""

from placeholder import stand_in

stand_in(__name__, "0.4.10")
