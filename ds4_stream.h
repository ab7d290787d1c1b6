/* ds4_stream.h -- the stream every GPU operation of the CUDA backend goes to.
 *
 * What it is.  A thread-local "current stream": ds4_current_stream() returns the override the
 * calling thread has pushed, or the legacy default stream (0) when there is none.  Every kernel
 * launch (DS4_LAUNCH, the one `<<<>>>` of the backend), memset, asynchronous copy, cuBLAS call
 * (DS4_CUBLAS sets the handle's stream first) and event record of ds4_cuda.cu and of the
 * benchmark programs that drive it goes to this stream; `make stream-check`
 * (scripts/check_streams.py) fails the build's tests when one does not.
 *
 * Why.  CUDA graph capture (DS4_CUDA_GRAPHS, the later stages of patches/series) needs all GPU
 * work of a decode step on one stream the engine controls.  This header is stage 0 of that
 * series.  From stage 1 on a context's session (ds4_gpu.h session_bind) pushes its own
 * non-blocking stream while it is bound, so a step's work goes there; with nothing bound,
 * operations go to stream 0.
 *
 * Usable from C (the benchmark programs) and C++ (ds4_cuda.cu, which defines the functions).
 */
#ifndef DS4_STREAM_H
#define DS4_STREAM_H

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Overrides nest up to this depth per thread. */
#define DS4_STREAM_DEPTH 8

/* The calling thread's current stream: its innermost override, else 0 (the legacy default
 * stream). */
cudaStream_t ds4_current_stream(void);

/* Make s the calling thread's current stream until the matching ds4_stream_pop.  Returns 0,
 * or -1 (and changes nothing) when DS4_STREAM_DEPTH overrides are already pushed. */
int ds4_stream_push(cudaStream_t s);

/* Drop the innermost override (none: nothing happens). */
void ds4_stream_pop(void);

#ifdef __cplusplus
}
#endif

#endif /* DS4_STREAM_H */
