// The copy kernel of CudaCopyStream (native/src/transport/cuda.cpp): many ranges in one
// launch, for block-sized KV copies where the copy engines pay a few microseconds per
// range. Each block takes whole ranges (grid-stride); its threads move 16 bytes each,
// four loads in flight, or single bytes where a range is not 16-byte aligned. Either side
// may be device memory or host memory the device can address (pinned with a device
// mapping): the caller checks that before choosing this path.
//
// Compiled to PTX by native/cuda/gen_ptx.py (NVRTC, no GPU needed) into
// native/src/transport/copy_ranges_ptx.h; the driver compiles the PTX for the card at
// first use.

struct alignas(16) Chunk {
  unsigned long long lo, hi;
};

struct Range {
  unsigned long long dst, src, len;
};

extern "C" __global__ void __launch_bounds__(256) mcr_copy_ranges(const Range* __restrict__ ranges,
                                                                  unsigned n) {
  for (unsigned i = blockIdx.x; i < n; i += gridDim.x) {
    const unsigned long long dst = ranges[i].dst, src = ranges[i].src, len = ranges[i].len;
    if (((dst | src | len) & 15ull) == 0) {
      Chunk* o = reinterpret_cast<Chunk*>(dst);
      const Chunk* s = reinterpret_cast<const Chunk*>(src);
      const unsigned long long m = len >> 4, step = blockDim.x;
      unsigned long long j = threadIdx.x;
      for (; j + 3 * step < m; j += 4 * step) {
        const Chunk a = s[j], b = s[j + step], c = s[j + 2 * step], d = s[j + 3 * step];
        o[j] = a;
        o[j + step] = b;
        o[j + 2 * step] = c;
        o[j + 3 * step] = d;
      }
      for (; j < m; j += step) o[j] = s[j];
    } else {
      unsigned char* o = reinterpret_cast<unsigned char*>(dst);
      const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
      for (unsigned long long j = threadIdx.x; j < len; j += blockDim.x) o[j] = s[j];
    }
  }
}
