// Host-callback trampolines enqueued on a CUDA stream (and captured in a graph): the stream
// calls the draft channel's plain C functions (draft_channel.c), so no Python runs inside a
// callback and no lock but the channel's own futex is taken there. Argument blocks are owned
// by the caller and must outlive every replay of a graph that captured them; the values behind
// their pointers (step number, row counts, tokens) are read when the callback runs.
//
// Built with nvcc where it exists, linked with draft_channel.c into libguidespec-cuda.so; CI
// compiles it without a GPU.
#include <cuda_runtime.h>

#include "draft_channel.h"

extern "C" {

// Publish a draft step's tokens (already copied device-to-host into page-locked memory by an
// earlier async copy on the same stream) to the scheduler.
int gs_enqueue_publish_drafts(cudaStream_t stream, gs_publish_args *args) {
    return (int)cudaLaunchHostFunc(stream, gs_cb_publish_drafts, args);
}

// Wait for the scheduler's mask of that draft step into page-locked rows, then copy them to the
// device: the bitmask kernel follows on the same stream. On a timeout, a dead scheduler or a
// stale step the rows are all zero (forbid every token) and the error slot says why.
int gs_enqueue_wait_mask(cudaStream_t stream, gs_wait_args *args, int32_t *device_rows, size_t max_bytes) {
    cudaError_t status = cudaLaunchHostFunc(stream, gs_cb_wait_mask, args);
    if (status != cudaSuccess) return (int)status;
    return (int)cudaMemcpyAsync(device_rows, args->out, max_bytes, cudaMemcpyHostToDevice, stream);
}

// Page-lock a host range (the mask arena, the callbacks' buffers) for asynchronous copies.
int gs_register_host(void *pointer, size_t bytes) {
    return (int)cudaHostRegister(pointer, bytes, cudaHostRegisterDefault);
}

int gs_unregister_host(void *pointer) { return (int)cudaHostUnregister(pointer); }

}  // extern "C"
