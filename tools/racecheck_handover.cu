// racecheck and bar.arrive: a minimal, correct hand-over of a shared-memory
// buffer in the form stage2_wide_kernel's epilogue warps use. 256 producer
// threads write y and arrive on named barrier 2; 128 consumer threads wait
// on 2, read y and arrive on 3; the producers wait on 3 before writing
// again. The result is right (it prints the value it wants), yet
// compute-sanitizer's racecheck reports the producers' writes against the
// consumers' reads (H200, CUDA 13.0, 2026-12-03): the tool does not model
// the ordering bar.arrive gives, and its reports on the wide stage 2's
// hand-over are of this kind.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a -o /tmp/handover tools/racecheck_handover.cu
//   /tmp/handover && compute-sanitizer --tool racecheck /tmp/handover
#include <cstdio>
__device__ __forceinline__ void bsync(int id, int n) { asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void barrive(int id, int n) { asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(n) : "memory"); }
__global__ void handover(float* out, int rounds) {
    __shared__ float y[256];
    const int tid = threadIdx.x;
    if (tid < 256) {
        for (int r = 0; r < rounds; ++r) {
            if (r > 0) bsync(3, 384);
            y[tid] = (float)(r * 1000 + tid);
            barrive(2, 384);
        }
    } else {
        const int c = tid - 256;
        float s = 0;
        for (int r = 0; r < rounds; ++r) {
            bsync(2, 384);
            s += y[c] + y[c + 128];
            if (r + 1 < rounds) barrive(3, 384);
        }
        out[blockIdx.x * 128 + c] = s;
    }
}
int main() {
    float* out; cudaMalloc(&out, 4 * 128 * sizeof(float));
    handover<<<4, 384>>>(out, 8);
    float h[512]; cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost);
    double want = 0; for (int r = 0; r < 8; ++r) want += 2 * r * 1000 + 0 + 128;
    printf("handover: out[0]=%g want %g, %s\n", h[0], want, cudaGetErrorString(cudaGetLastError()));
    return 0;
}
