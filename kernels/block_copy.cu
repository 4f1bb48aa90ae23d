// kvswap block copy: move the blocks of one task between a rank's device
// tensors and its host swap space, for every tensor, in ONE launch.
//
// Compiled at run time by NVRTC through cupy.RawModule (kernels/cuda_copy.py),
// so it includes no headers and uses only built-in types.
//
// The host swap space is pinned with cudaHostRegister(portable | mapped), so
// the kernel reads and writes it directly through its device-mapped address:
// no staging copy, and scattered blocks cost one warp each instead of one
// cudaMemcpyAsync each.  Long runs of consecutive blocks are not sent here;
// the host side gives them to cudaMemcpyAsync (copy engines).
//
// Work decomposition.  Every block of tensor t is cut into segments of
// `segment_bytes` (the last one may be shorter); seg_first[t] numbers the
// segments of all tensors of ONE block id consecutively, total_segs in all.
// One warp moves one item = (block id k, segment s), items numbered
// k * total_segs + s, with a grid-stride loop so any grid size covers all.
// Segments keep big blocks (512 KiB) spread over many warps while small
// blocks (4 KiB) stay one item each.
//
// Access width.  vec_bytes (16, 8, 4 or 1) divides both base addresses, the
// block size and segment_bytes, so every access of every item is aligned.
// The host picks it per tensor (pick_vector_width) and this kernel dispatches
// per item; all lanes of a warp take the same branch.
//
// The table layout must match TABLE_DTYPE in kernels/cuda_copy.py and the
// parameter list must match kernel_args() there (a CPU test checks both).

#define KVSWAP_WARP 32
#define KVSWAP_UNROLL 4

struct TensorEntry {
    unsigned long long device;       // device address of block 0 of the device tensor
    unsigned long long host;         // device-mapped address of block 0 of its host region
    unsigned long long block_bytes;  // bytes per block
    unsigned long long vec_bytes;    // access width: 16, 8, 4 or 1
    unsigned long long seg_first;    // index of the tensor's first segment within one block id
};

// Largest t with table[t].seg_first <= seg (seg_first is increasing, seg_first[0] == 0).
__device__ __forceinline__ int find_tensor(const TensorEntry* __restrict__ table, int num_tensors,
                                           unsigned long long seg)
{
    int lo = 0;
    int hi = num_tensors - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (table[mid].seg_first <= seg) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// One warp copies `bytes` (a multiple of sizeof(V)).  Several independent loads
// are issued before their stores: reads of mapped host memory cross PCIe and
// take microseconds, so a warp needs many in flight to approach link bandwidth.
template <typename V>
__device__ __forceinline__ void copy_range(const char* src, char* dst, unsigned long long bytes,
                                           unsigned int lane)
{
    const V* __restrict__ s = reinterpret_cast<const V*>(src);
    V* __restrict__ d = reinterpret_cast<V*>(dst);
    const unsigned long long n = bytes / sizeof(V);
    unsigned long long i = lane;
    for (; i + (KVSWAP_UNROLL - 1) * KVSWAP_WARP < n; i += KVSWAP_UNROLL * KVSWAP_WARP) {
        V v[KVSWAP_UNROLL];
#pragma unroll
        for (int u = 0; u < KVSWAP_UNROLL; ++u) {
            v[u] = s[i + u * KVSWAP_WARP];
        }
#pragma unroll
        for (int u = 0; u < KVSWAP_UNROLL; ++u) {
            d[i + u * KVSWAP_WARP] = v[u];
        }
    }
    for (; i < n; i += KVSWAP_WARP) {
        d[i] = s[i];
    }
}

extern "C" __global__ void kvswap_block_copy(const TensorEntry* __restrict__ table,
                                             int num_tensors,
                                             unsigned long long total_segs,
                                             unsigned long long segment_bytes,
                                             const long long* __restrict__ device_ids,
                                             const long long* __restrict__ host_ids,
                                             unsigned long long num_ids,
                                             int to_host)
{
    const unsigned int lane = threadIdx.x % KVSWAP_WARP;
    const unsigned long long warps_per_cta = blockDim.x / KVSWAP_WARP;
    const unsigned long long items = num_ids * total_segs;
    const unsigned long long stride = (unsigned long long)gridDim.x * warps_per_cta;
    for (unsigned long long item = (unsigned long long)blockIdx.x * warps_per_cta
                                   + threadIdx.x / KVSWAP_WARP;
         item < items; item += stride) {
        const unsigned long long k = item / total_segs;
        const unsigned long long seg = item - k * total_segs;
        const TensorEntry e = table[find_tensor(table, num_tensors, seg)];
        const unsigned long long lo = (seg - e.seg_first) * segment_bytes;
        const unsigned long long end = lo + segment_bytes;
        const unsigned long long bytes = (end < e.block_bytes ? end : e.block_bytes) - lo;
        char* dev = reinterpret_cast<char*>(e.device)
                    + (unsigned long long)device_ids[k] * e.block_bytes + lo;
        char* host = reinterpret_cast<char*>(e.host)
                     + (unsigned long long)host_ids[k] * e.block_bytes + lo;
        const char* src = to_host ? dev : host;
        char* dst = to_host ? host : dev;
        switch (e.vec_bytes) {
        case 16:
            copy_range<uint4>(src, dst, bytes, lane);
            break;
        case 8:
            copy_range<unsigned long long>(src, dst, bytes, lane);
            break;
        case 4:
            copy_range<unsigned int>(src, dst, bytes, lane);
            break;
        default:
            copy_range<unsigned char>(src, dst, bytes, lane);
            break;
        }
    }
}
