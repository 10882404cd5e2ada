// standin.cpp: stand-in GPU driver libraries over the simulated device, so that the real bindings
// (cuda-python, hip-python) can be driven end to end on a machine without a GPU.
//
// One library exports both APIs; it is installed under the names the bindings open:
//   libcuda.so.1     cuda-python dlopens it and asks cuGetProcAddress_v2 for every entry point
//   libamdhip64.so   hip-python dlopens it by that plain name and dlsyms each function
// Memory, streams, events and launches go to the simulator's driver (sim_driver.cpp, compiled in).
//
// A code object handed to cuModuleLoadData / hipModuleLoadData is checked, not run: it must be an
// ELF for the device's target (a cubin's SM in e_flags, an AMDGPU code object's machine), and every
// kernel it defines (its function symbols) must exist in the simulator's builds of the same source,
// which the harness puts in $FOMOE_STANDIN_MODULES. A launch runs that build, with the packed
// parameter block the binding passed.
//
// Settings: FOMOE_STANDIN_DEVICES (default 2), FOMOE_STANDIN_MEMORY (bytes per device, default 16 GiB),
// FOMOE_STANDIN_DEFERRED=1 (streams run only what a sync or an event needs), FOMOE_STANDIN_SM (90),
// FOMOE_STANDIN_GFX (gfx1030: what Debian's hiprtc compiles; a real RDNA4 card reports gfx1201),
// FOMOE_STANDIN_WARP (32: the lanes of a warp the device reports; 64 plays a wave64 GCN/CDNA card),
// FOMOE_STANDIN_NULL=1 (the null device: nothing runs, device memory is address space only; for timing
// the host's own calls through the real bindings, bench/host_time.py); with it, FOMOE_STANDIN_KERNEL_BW
// and FOMOE_STANDIN_LINK_BW (bytes per second, both) make it an emulated-cost device (sim_timing.h:
// launches take the bytes they read / the kernel rate, copies bytes / the link rate, syncs wait;
// FOMOE_STANDIN_SPIN_US: how long before the device's time a waiting host stops sleeping and spins;
// FOMOE_STANDIN_TIMELINE: a file each timed op and synchronisation is written to, as it is placed).
#include "sim_driver.cpp"

#include <dirent.h>
#include <elf.h>

#include <set>

namespace {

std::once_flag standin_once;
std::vector<Module*> sim_builds;  // every kernel of the simulator's builds
std::string standin_error;

int env_int(const char* name, long long fallback) {
    const char* v = getenv(name);
    return v && *v ? (int)atoll(v) : (int)fallback;
}

void standin_init() {
    std::call_once(standin_once, [] {
        const char* mem = getenv("FOMOE_STANDIN_MEMORY");
        sim_configure(env_int("FOMOE_STANDIN_DEVICES", 2), mem && *mem ? strtoull(mem, nullptr, 10) : (16ull << 30),
                      env_int("FOMOE_STANDIN_DEFERRED", 0));
        sim_set_null(env_int("FOMOE_STANDIN_NULL", 0));
        const char* kernel_bw = getenv("FOMOE_STANDIN_KERNEL_BW");
        const char* link_bw = getenv("FOMOE_STANDIN_LINK_BW");
        if ((kernel_bw && *kernel_bw) || (link_bw && *link_bw)) {
            if (sim_set_timing(kernel_bw ? atof(kernel_bw) : 0.0, link_bw ? atof(link_bw) : 0.0) != OK) {
                standin_error = "FOMOE_STANDIN_KERNEL_BW, FOMOE_STANDIN_LINK_BW: " + last_error;
                return;
            }
        }
        const char* dir = getenv("FOMOE_STANDIN_MODULES");
        if (!dir || !*dir) {
            standin_error = "FOMOE_STANDIN_MODULES is not set: no simulator builds of the kernels to run";
            return;
        }
        DIR* d = opendir(dir);
        if (!d) {
            standin_error = std::string("FOMOE_STANDIN_MODULES: cannot open ") + dir;
            return;
        }
        while (dirent* e = readdir(d)) {
            std::string name = e->d_name;
            if (name.size() < 4 || name.compare(name.size() - 3, 3, ".so") != 0) continue;
            std::string path = std::string(dir) + "/" + name;
            FILE* f = fopen(path.c_str(), "rb");
            if (!f) continue;
            std::vector<char> bytes;
            char buf[65536];
            size_t n;
            while ((n = fread(buf, 1, sizeof buf, f)) > 0) bytes.insert(bytes.end(), buf, buf + n);
            fclose(f);
            void* m = nullptr;
            if (sim_module_load(0, bytes.data(), bytes.size(), &m) == OK) sim_builds.push_back(static_cast<Module*>(m));
        }
        closedir(d);
        if (sim_builds.empty()) standin_error = std::string("no simulator builds (*.so) in ") + dir;
    });
}

const KernelInfo* sim_kernel(const char* name) {
    for (Module* m : sim_builds)
        for (int i = 0; i < m->n_kernels; i++)
            if (strcmp(m->kernels[i].name, name) == 0) return &m->kernels[i];
    return nullptr;
}

// The global function symbols of an ELF code object (its kernels), and its e_machine / e_flags.
bool elf_functions(const void* image, std::set<std::string>& out, uint16_t* machine, uint32_t* flags) {
    const unsigned char* p = static_cast<const unsigned char*>(image);
    if (memcmp(p, ELFMAG, SELFMAG) != 0 || p[EI_CLASS] != ELFCLASS64) return false;
    const Elf64_Ehdr* eh = reinterpret_cast<const Elf64_Ehdr*>(p);
    *machine = eh->e_machine;
    *flags = eh->e_flags;
    const Elf64_Shdr* sh = reinterpret_cast<const Elf64_Shdr*>(p + eh->e_shoff);
    for (int i = 0; i < eh->e_shnum; i++) {
        if (sh[i].sh_type != SHT_SYMTAB && sh[i].sh_type != SHT_DYNSYM) continue;
        const Elf64_Sym* syms = reinterpret_cast<const Elf64_Sym*>(p + sh[i].sh_offset);
        const char* strtab = reinterpret_cast<const char*>(p + sh[sh[i].sh_link].sh_offset);
        for (size_t s = 0; s < sh[i].sh_size / sizeof(Elf64_Sym); s++)
            if (ELF64_ST_TYPE(syms[s].st_info) == STT_FUNC && ELF64_ST_BIND(syms[s].st_info) == STB_GLOBAL &&
                syms[s].st_shndx != SHN_UNDEF && syms[s].st_name)
                out.insert(strtab + syms[s].st_name);
    }
    return true;
}

// What a code object says of a kernel's parameters: their sizes in order, and its launch bound (0: unknown)
struct KernelMeta {
    std::vector<int> sizes;
    int max_threads = 0;
};

// cubin: section .nv.info.<kernel> holds attributes; EIATTR_KPARAM_INFO (0x17, 12 bytes) gives a
// parameter's ordinal and, in bits 18-31 of its last word, its size
void cubin_meta(const unsigned char* p, std::map<std::string, KernelMeta>& out) {
    const Elf64_Ehdr* eh = reinterpret_cast<const Elf64_Ehdr*>(p);
    const Elf64_Shdr* sh = reinterpret_cast<const Elf64_Shdr*>(p + eh->e_shoff);
    const char* names = reinterpret_cast<const char*>(p + sh[eh->e_shstrndx].sh_offset);
    for (int i = 0; i < eh->e_shnum; i++) {
        const char* name = names + sh[i].sh_name;
        if (strncmp(name, ".nv.info.", 9) != 0) continue;
        std::map<int, int> by_ordinal;
        const unsigned char* d = p + sh[i].sh_offset;
        for (size_t at = 0; at + 2 <= sh[i].sh_size;) {
            const int format = d[at], attribute = d[at + 1];
            if (format == 4) {  // EIFMT_SVAL: u16 size, then the payload
                uint16_t n;
                memcpy(&n, d + at + 2, 2);
                if (attribute == 0x17 && n >= 12) {
                    uint16_t ordinal;
                    uint32_t word;
                    memcpy(&ordinal, d + at + 8, 2);
                    memcpy(&word, d + at + 12, 4);
                    by_ordinal[ordinal] = (int)((word >> 18) & 0x3fff);
                }
                at += 4 + n;
            } else if (format == 3) {  // EIFMT_HVAL: u16 value
                at += 4;
            } else {  // EIFMT_NVAL / BVAL
                at += format == 2 ? 3 : 2;
            }
        }
        KernelMeta& m = out[name + 9];
        for (auto& [ordinal, size] : by_ordinal) m.sizes.push_back(size);
    }
}

// AMDGPU: the NT_AMDGPU_METADATA note is a msgpack map; amdhsa.kernels lists each kernel's .name,
// .args (.size, .value_kind; "hidden_*" arguments are the runtime's own) and .max_flat_workgroup_size
struct Msgpack {
    const unsigned char *p, *end;
    bool ok = true;
    enum Type { MAP, ARRAY, STR, INT, OTHER };
    uint64_t be(int n) {
        uint64_t v = 0;
        for (int i = 0; i < n; i++) v = (v << 8) | p[i];
        p += n;
        return v;
    }
    // one header: MAP/ARRAY give their count, STR its bytes in s, INT its value; OTHER is skipped whole
    Type next(uint64_t& n, const char*& s) {
        if (p >= end) {
            ok = false;
            return OTHER;
        }
        const unsigned c = *p++;
        if (c <= 0x7f) return n = c, INT;
        if ((c & 0xf0) == 0x80) return n = c & 0x0f, MAP;
        if ((c & 0xf0) == 0x90) return n = c & 0x0f, ARRAY;
        if ((c & 0xe0) == 0xa0) return n = c & 0x1f, s = (const char*)p, p += n, STR;
        if (c >= 0xe0) return n = 0, INT;
        switch (c) {
            case 0xcc: return n = be(1), INT;
            case 0xcd: return n = be(2), INT;
            case 0xce: return n = be(4), INT;
            case 0xcf: return n = be(8), INT;
            case 0xd0: return n = be(1), INT;
            case 0xd1: return n = be(2), INT;
            case 0xd2: return n = be(4), INT;
            case 0xd3: return n = be(8), INT;
            case 0xd9: n = be(1); return s = (const char*)p, p += n, STR;
            case 0xda: n = be(2); return s = (const char*)p, p += n, STR;
            case 0xdb: n = be(4); return s = (const char*)p, p += n, STR;
            case 0xdc: return n = be(2), ARRAY;
            case 0xdd: return n = be(4), ARRAY;
            case 0xde: return n = be(2), MAP;
            case 0xdf: return n = be(4), MAP;
            case 0xc4: p += be(1); return OTHER;
            case 0xc5: p += be(2); return OTHER;
            case 0xc6: p += be(4); return OTHER;
            case 0xca: p += 4; return OTHER;
            case 0xcb: p += 8; return OTHER;
            case 0xc0: case 0xc2: case 0xc3: return OTHER;
            default: ok = false; return OTHER;
        }
    }
    void skip() {
        uint64_t n;
        const char* s;
        const Type t = next(n, s);
        if (t == MAP) n *= 2;
        if (t == MAP || t == ARRAY)
            for (uint64_t i = 0; i < n && ok; i++) skip();
    }
    std::string key() {
        uint64_t n;
        const char* s = nullptr;
        if (next(n, s) != STR) return ok = false, std::string();
        return std::string(s, n);
    }
};

void amdgpu_meta(const unsigned char* p, std::map<std::string, KernelMeta>& out) {
    const Elf64_Ehdr* eh = reinterpret_cast<const Elf64_Ehdr*>(p);
    const Elf64_Shdr* sh = reinterpret_cast<const Elf64_Shdr*>(p + eh->e_shoff);
    for (int i = 0; i < eh->e_shnum; i++) {
        if (sh[i].sh_type != SHT_NOTE) continue;
        for (size_t at = sh[i].sh_offset; at + 12 <= sh[i].sh_offset + sh[i].sh_size;) {
            const Elf64_Nhdr* nh = reinterpret_cast<const Elf64_Nhdr*>(p + at);
            const unsigned char* desc = p + at + 12 + ((nh->n_namesz + 3) & ~3u);
            at += 12 + ((nh->n_namesz + 3) & ~3u) + ((nh->n_descsz + 3) & ~3u);
            if (nh->n_type != 32) continue;  // NT_AMDGPU_METADATA
            Msgpack m{desc, desc + nh->n_descsz};
            uint64_t n;
            const char* s;
            if (m.next(n, s) != Msgpack::MAP) return;
            for (uint64_t k = 0; k < n && m.ok; k++) {
                if (m.key() != "amdhsa.kernels") {
                    m.skip();
                    continue;
                }
                uint64_t n_kernels;
                if (m.next(n_kernels, s) != Msgpack::ARRAY) return;
                for (uint64_t j = 0; j < n_kernels && m.ok; j++) {
                    KernelMeta meta;
                    std::string name;
                    uint64_t n_fields;
                    if (m.next(n_fields, s) != Msgpack::MAP) return;
                    for (uint64_t f = 0; f < n_fields && m.ok; f++) {
                        const std::string field = m.key();
                        uint64_t v;
                        if (field == ".name" && m.next(v, s) == Msgpack::STR) {
                            name.assign(s, v);
                        } else if (field == ".max_flat_workgroup_size" && m.next(v, s) == Msgpack::INT) {
                            meta.max_threads = (int)v;
                        } else if (field == ".args") {
                            uint64_t n_args;
                            if (m.next(n_args, s) != Msgpack::ARRAY) return;
                            for (uint64_t a = 0; a < n_args && m.ok; a++) {
                                uint64_t n_props;
                                if (m.next(n_props, s) != Msgpack::MAP) return;
                                int size = 0;
                                bool hidden = false;
                                for (uint64_t q = 0; q < n_props && m.ok; q++) {
                                    const std::string prop = m.key();
                                    const Msgpack::Type t = m.next(v, s);
                                    if (prop == ".size" && t == Msgpack::INT) size = (int)v;
                                    if (prop == ".value_kind" && t == Msgpack::STR) hidden = v >= 7 && strncmp(s, "hidden_", 7) == 0;
                                    if (t == Msgpack::MAP || t == Msgpack::ARRAY) {  // nested: skip its contents
                                        for (uint64_t e = 0; e < (t == Msgpack::MAP ? 2 * v : v) && m.ok; e++) m.skip();
                                    }
                                }
                                if (!hidden) meta.sizes.push_back(size);
                            }
                        } else {
                            m.skip();
                        }
                    }
                    if (!name.empty()) out[name] = meta;
                }
            }
        }
    }
}

struct CodeObject {
    std::set<std::string> kernels;
};
std::mutex code_objects_mutex;
std::vector<std::unique_ptr<CodeObject>> code_objects;

// machine: EM_CUDA (190) with the SM in e_flags' low byte, or EM_AMDGPU (224) with the gfx in its mach bits
// target = (e_flags >> shift) & mask: a cubin of the ELF ABI NVRTC 13 writes keeps its SM in bits 8-15
int load_code_object(const void* image, uint16_t want_machine, uint32_t want_target, int shift, uint32_t target_mask,
                     const char* target_name, void** out) {
    standin_init();
    if (!standin_error.empty()) return fail(INVALID_IMAGE, "%s", standin_error.c_str());
    auto co = std::make_unique<CodeObject>();
    uint16_t machine;
    uint32_t flags;
    if (!elf_functions(image, co->kernels, &machine, &flags))
        return fail(INVALID_IMAGE, "the module image is not a 64-bit ELF code object");
    const uint32_t target = (flags >> shift) & target_mask;
    if (machine != want_machine || target != want_target)
        return fail(INVALID_IMAGE, "the code object is for machine %u target %u (0x%x), the device is %s", machine, target, target,
                    target_name);
    if (co->kernels.empty()) return fail(INVALID_IMAGE, "the code object defines no kernel");
    // the parameters the code object declares must be the ones the simulator's build declares (whose
    // sizes tests/test_sim_device.py ties to KERNEL_SIGNATURES): the same block is passed to both
    std::map<std::string, KernelMeta> meta;
    if (machine == 190) cubin_meta(static_cast<const unsigned char*>(image), meta);
    else amdgpu_meta(static_cast<const unsigned char*>(image), meta);
    for (const std::string& k : co->kernels) {
        const KernelInfo* sim = sim_kernel(k.c_str());
        if (!sim) return fail(INVALID_IMAGE, "kernel %s of the code object has no simulator build", k.c_str());
        auto it = meta.find(k);
        if (it == meta.end()) return fail(INVALID_IMAGE, "kernel %s: the code object has no parameter metadata for it", k.c_str());
        std::vector<int> sim_sizes(sim->param_size, sim->param_size + sim->n_params);
        if (it->second.sizes != sim_sizes) {
            std::string a, b;
            for (int v : it->second.sizes) a += std::to_string(v) + " ";
            for (int v : sim_sizes) b += std::to_string(v) + " ";
            return fail(INVALID_IMAGE, "kernel %s: the code object's parameter sizes [ %s] differ from the source's [ %s]", k.c_str(),
                        a.c_str(), b.c_str());
        }
        if (it->second.max_threads && it->second.max_threads != sim->max_threads)
            return fail(INVALID_IMAGE, "kernel %s: launch bound %d in the code object, %d in the source", k.c_str(),
                        it->second.max_threads, sim->max_threads);
    }
    std::lock_guard<std::mutex> g(code_objects_mutex);
    code_objects.push_back(std::move(co));
    *out = code_objects.back().get();
    return OK;
}

int code_object_function(void** out, void* module, const char* name) {
    CodeObject* co = static_cast<CodeObject*>(module);
    if (!co->kernels.count(name)) return fail(NOT_FOUND, "kernel %s is not in this code object", name);
    *out = (void*)sim_kernel(name);
    return OK;
}

thread_local int current_device = 0;

// per device: one stream stands for the legacy default stream (0)
Stream* stream_or_default(void* s) {
    static std::mutex m;
    static std::map<int, void*> defaults;
    if (s) return static_cast<Stream*>(s);
    std::lock_guard<std::mutex> g(m);
    void*& d = defaults[current_device];
    if (!d) sim_stream_create(current_device, &d);
    return static_cast<Stream*>(d);
}

int device_of(uint64_t ptr) {
    std::lock_guard<std::mutex> g(memory_mutex);
    const Allocation* a = find((uintptr_t)ptr, 1);
    return a ? a->device : -1;
}

}  // namespace

// ======================================== CUDA driver API ========================================
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

static CUresult cu(int status) { return status; }

EXPORT CUresult cuInit(unsigned) {
    standin_init();
    return OK;
}
EXPORT CUresult cuDriverGetVersion(int* v) {
    *v = 13000;
    return OK;
}
EXPORT CUresult cuDeviceGetCount(int* n) {
    standin_init();
    return sim_device_count(n);
}
EXPORT CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (!valid_device(ordinal)) return fail(INVALID_DEVICE, "no device %d", ordinal);
    *d = ordinal;
    return OK;
}
EXPORT CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    snprintf(name, len, "fomoepy stand-in CUDA device %d (simulated)", d);
    return OK;
}
EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
    size_t free_bytes;
    return sim_mem_info(d, &free_bytes, bytes);
}
EXPORT CUresult cuDeviceGetAttribute(int* value, int attribute, CUdevice) {
    const int sm = env_int("FOMOE_STANDIN_SM", 90);
    if (attribute == 75) *value = sm / 10;        // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    else if (attribute == 76) *value = sm % 10;   // ..._MINOR
    else if (attribute == 10) *value = env_int("FOMOE_STANDIN_WARP", 32);  // CU_DEVICE_ATTRIBUTE_WARP_SIZE
    else return fail(INVALID_VALUE, "device attribute %d is not simulated", attribute);
    return OK;
}
EXPORT CUresult cuDevicePrimaryCtxRetain(void** ctx, CUdevice d) {
    if (!valid_device(d)) return fail(INVALID_DEVICE, "no device %d", d);
    *ctx = (void*)(uintptr_t)(d + 1);  // a context is its device, plus one so that none is null
    return OK;
}
EXPORT CUresult cuCtxSetCurrent(void* ctx) {
    current_device = ctx ? (int)(uintptr_t)ctx - 1 : 0;
    return OK;
}
EXPORT CUresult cuCtxGetCurrent(void** ctx) {
    *ctx = (void*)(uintptr_t)(current_device + 1);
    return OK;
}
EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) { return sim_mem_info(current_device, free_bytes, total); }
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
    void* out = nullptr;
    int s = sim_malloc(current_device, &out, n);
    *p = (CUdeviceptr)(uintptr_t)out;
    return s;
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { return sim_free((void*)(uintptr_t)p); }
EXPORT CUresult cuMemAllocHost_v2(void** p, size_t n) { return sim_host_alloc(p, n); }
EXPORT CUresult cuMemFreeHost(void* p) { return sim_host_free(p); }
EXPORT CUresult cuMemHostRegister_v2(void* p, size_t n, unsigned) { return sim_host_register(p, n); }
EXPORT CUresult cuMemHostUnregister(void* p) { return sim_host_unregister(p); }
EXPORT CUresult cuStreamCreate(void** s, unsigned) { return sim_stream_create(current_device, s); }
EXPORT CUresult cuStreamSynchronize(void* s) { return sim_stream_sync(stream_or_default(s)); }
EXPORT CUresult cuStreamWaitEvent(void* s, void* e, unsigned) { return sim_stream_wait_event(stream_or_default(s), e); }
EXPORT CUresult cuEventCreate(void** e, unsigned) { return sim_event_create(current_device, e); }
EXPORT CUresult cuEventRecord(void* e, void* s) { return sim_event_record(e, stream_or_default(s)); }
EXPORT CUresult cuEventSynchronize(void* e) { return sim_event_sync(e); }
EXPORT CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) { return sim_event_elapsed(ms, a, b); }
EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void* s) {
    return sim_memcpy_async((void*)(uintptr_t)dst, src, n, stream_or_default(s), 1);
}
EXPORT CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* s) {
    return sim_memcpy_async(dst, (const void*)(uintptr_t)src, n, stream_or_default(s), 2);
}
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void* s) {
    return sim_memcpy_async((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n, stream_or_default(s), 3);
}
EXPORT CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned v, size_t n, void* s) {
    return sim_memset_d32_async((void*)(uintptr_t)dst, v, n, stream_or_default(s));
}
EXPORT CUresult cuModuleLoadData(void** module, const void* image) {
    const int sm = env_int("FOMOE_STANDIN_SM", 90);
    char target[16];
    snprintf(target, sizeof target, "sm_%d", sm);
    return load_code_object(image, 190 /* EM_CUDA */, (uint32_t)sm, 8, 0xff, target, module);
}
EXPORT CUresult cuModuleGetFunction(void** fn, void* module, const char* name) { return code_object_function(fn, module, name); }
EXPORT CUresult cuLaunchKernel(void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared,
                               void* s, void** params, void** extra) {
    if (extra) return fail(INVALID_VALUE, "launch: the extra argument is not simulated (pass kernelParams)");
    Stream* st = stream_or_default(s);
    // a stream belongs to its context: CUDA refuses a launch on one while another device's context is current
    if (st->device != current_device)
        return fail(INVALID_HANDLE, "launch: the stream is device %d's, but device %d's context is current", st->device, current_device);
    return sim_launch(fn, gx, gy, gz, bx, by, bz, shared, st, params);
}
EXPORT CUresult cuGetErrorString(CUresult, const char** text) {
    *text = last_error.c_str();
    return OK;
}
EXPORT CUresult cuGetErrorName(CUresult status, const char** text) {
    static thread_local char name[32];
    snprintf(name, sizeof name, "CUDA_ERROR_%d", status);
    *text = name;
    return OK;
}

// NVRTC dlopens the driver too and asks it for private tables: there are none here
EXPORT CUresult cuGetExportTable(const void** table, const void*) {
    *table = nullptr;
    return 801;  // CUDA_ERROR_NOT_SUPPORTED
}

// cuda-python asks for each entry point by its base name and the CUDA version that introduced the
// ABI it expects; the versions it asks for are the ones implemented above (_v2 where they differ).
struct Entry {
    const char* name;
    void* fn;
};
#define E(name, fn) {name, (void*)&fn}
static const Entry CUDA_ENTRIES[] = {
    E("cuInit", cuInit), E("cuDriverGetVersion", cuDriverGetVersion), E("cuDeviceGetCount", cuDeviceGetCount),
    E("cuDeviceGet", cuDeviceGet), E("cuDeviceGetName", cuDeviceGetName), E("cuDeviceTotalMem", cuDeviceTotalMem_v2),
    E("cuDeviceGetAttribute", cuDeviceGetAttribute), E("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain),
    E("cuCtxSetCurrent", cuCtxSetCurrent), E("cuCtxGetCurrent", cuCtxGetCurrent), E("cuMemGetInfo", cuMemGetInfo_v2),
    E("cuMemAlloc", cuMemAlloc_v2), E("cuMemFree", cuMemFree_v2), E("cuMemAllocHost", cuMemAllocHost_v2),
    E("cuMemFreeHost", cuMemFreeHost), E("cuMemHostRegister", cuMemHostRegister_v2), E("cuMemHostUnregister", cuMemHostUnregister),
    E("cuStreamCreate", cuStreamCreate), E("cuStreamSynchronize", cuStreamSynchronize), E("cuStreamWaitEvent", cuStreamWaitEvent),
    E("cuEventCreate", cuEventCreate), E("cuEventRecord", cuEventRecord), E("cuEventSynchronize", cuEventSynchronize),
    E("cuEventElapsedTime", cuEventElapsedTime_v2), E("cuMemcpyHtoDAsync", cuMemcpyHtoDAsync_v2),
    E("cuMemcpyDtoHAsync", cuMemcpyDtoHAsync_v2), E("cuMemcpyDtoDAsync", cuMemcpyDtoDAsync_v2),
    E("cuMemsetD32Async", cuMemsetD32Async), E("cuModuleLoadData", cuModuleLoadData),
    E("cuModuleGetFunction", cuModuleGetFunction), E("cuLaunchKernel", cuLaunchKernel),
    E("cuGetErrorString", cuGetErrorString), E("cuGetErrorName", cuGetErrorName),
};

EXPORT CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int, unsigned long long, int* status) {
    for (const Entry& e : CUDA_ENTRIES)
        if (strcmp(e.name, symbol) == 0) {
            *pfn = e.fn;
            if (status) *status = 0;  // CU_GET_PROC_ADDRESS_SUCCESS
            return OK;
        }
    *pfn = nullptr;
    if (status) *status = 1;  // CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
    return NOT_FOUND;
}

// ========================================= HIP runtime API =========================================
typedef int hipError_t;

EXPORT hipError_t hipInit(unsigned) {
    standin_init();
    return OK;
}
EXPORT hipError_t hipGetDeviceCount(int* n) {
    standin_init();
    return sim_device_count(n);
}
EXPORT hipError_t hipSetDevice(int d) {
    if (!valid_device(d)) return fail(INVALID_DEVICE, "no device %d", d);
    current_device = d;
    return OK;
}
// hip-python 7.2 resolves hipGetDeviceProperties to this ROCm 6 symbol; a ROCm 5 runtime lacks it
// (FOMOE_STANDIN_ROCM5 builds one like that, exporting ROCm 5's name instead)
#ifdef FOMOE_STANDIN_ROCM5
EXPORT hipError_t hipGetDeviceProperties(void* props, int d) {
#else
EXPORT hipError_t hipGetDevicePropertiesR0600(void* props, int d) {
#endif
    if (!valid_device(d)) return fail(INVALID_DEVICE, "no device %d", d);
    char* p = static_cast<char*>(props);
    memset(p, 0, 1472);
    snprintf(p, 256, "fomoepy stand-in HIP device %d (simulated)", d);
    size_t free_bytes, total;
    sim_mem_info(d, &free_bytes, &total);
    const int warp = env_int("FOMOE_STANDIN_WARP", 32);
#ifdef FOMOE_STANDIN_ROCM5
    memcpy(p + 256, &total, sizeof total);  // ROCm 5's hipDeviceProp_t: name, totalGlobalMem, ..., warpSize at 276
    memcpy(p + 276, &warp, sizeof warp);
#else
    memcpy(p + 288, &total, sizeof total);  // hipDeviceProp_tR0600: name, uuid, luid, mask, totalGlobalMem, ..., warpSize at 308
    memcpy(p + 308, &warp, sizeof warp);
#endif
    const char* gfx = getenv("FOMOE_STANDIN_GFX");
    snprintf(p + 1160, 256, "%s:sramecc-:xnack-", gfx && *gfx ? gfx : "gfx1030");
    return OK;
}
EXPORT hipError_t hipDriverGetVersion(int* v) {
    *v = 60443000;
    return OK;
}
EXPORT hipError_t hipMemGetInfo(size_t* free_bytes, size_t* total) { return sim_mem_info(current_device, free_bytes, total); }
EXPORT hipError_t hipMalloc(void** p, size_t n) { return sim_malloc(current_device, p, n); }
EXPORT hipError_t hipFree(void* p) { return sim_free(p); }
EXPORT hipError_t hipHostMalloc(void** p, size_t n, unsigned) { return sim_host_alloc(p, n); }
EXPORT hipError_t hipHostFree(void* p) { return sim_host_free(p); }
EXPORT hipError_t hipHostRegister(void* p, size_t n, unsigned) { return sim_host_register(p, n); }
EXPORT hipError_t hipHostUnregister(void* p) { return sim_host_unregister(p); }
EXPORT hipError_t hipStreamCreateWithFlags(void** s, unsigned) { return sim_stream_create(current_device, s); }
EXPORT hipError_t hipStreamSynchronize(void* s) { return sim_stream_sync(stream_or_default(s)); }
EXPORT hipError_t hipStreamWaitEvent(void* s, void* e, unsigned) { return sim_stream_wait_event(stream_or_default(s), e); }
EXPORT hipError_t hipEventCreateWithFlags(void** e, unsigned) { return sim_event_create(current_device, e); }
EXPORT hipError_t hipEventRecord(void* e, void* s) { return sim_event_record(e, stream_or_default(s)); }
EXPORT hipError_t hipEventSynchronize(void* e) { return sim_event_sync(e); }
EXPORT hipError_t hipEventElapsedTime(float* ms, void* a, void* b) { return sim_event_elapsed(ms, a, b); }
EXPORT hipError_t hipMemcpyHtoDAsync(void* dst, const void* src, size_t n, void* s) {
    return sim_memcpy_async(dst, src, n, stream_or_default(s), 1);
}
EXPORT hipError_t hipMemcpyDtoHAsync(void* dst, const void* src, size_t n, void* s) {
    return sim_memcpy_async(dst, src, n, stream_or_default(s), 2);
}
EXPORT hipError_t hipMemcpyDtoDAsync(void* dst, const void* src, size_t n, void* s) {
    return sim_memcpy_async(dst, src, n, stream_or_default(s), 3);
}
EXPORT hipError_t hipMemsetD32Async(void* dst, int v, size_t n, void* s) {
    return sim_memset_d32_async(dst, (unsigned)v, n, stream_or_default(s));
}
EXPORT hipError_t hipModuleLoadData(void** module, const void* image) {
    const char* gfx = getenv("FOMOE_STANDIN_GFX");
    std::string name = gfx && *gfx ? gfx : "gfx1030";
    // EF_AMDGPU_MACH values (llvm/BinaryFormat/ELF.h)
    const std::map<std::string, uint32_t> mach = {{"gfx1030", 0x036}, {"gfx1100", 0x041}, {"gfx1200", 0x048}, {"gfx1201", 0x04e}};
    auto it = mach.find(name);
    if (it == mach.end()) return fail(INVALID_VALUE, "FOMOE_STANDIN_GFX=%s is not a target the stand-in knows", name.c_str());
    return load_code_object(image, 224 /* EM_AMDGPU */, it->second, 0, 0xff, name.c_str(), module);
}
EXPORT hipError_t hipModuleGetFunction(void** fn, void* module, const char* name) { return code_object_function(fn, module, name); }
EXPORT hipError_t hipModuleLaunchKernel(void* fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                        unsigned shared, void* s, void** params, void** extra) {
    if (extra) return fail(INVALID_VALUE, "launch: the extra argument is not simulated (pass kernelParams)");
    return sim_launch(fn, gx, gy, gz, bx, by, bz, shared, stream_or_default(s), params);
}
EXPORT const char* hipGetErrorString(hipError_t) { return last_error.c_str(); }
EXPORT const char* hipGetErrorName(hipError_t) { return "hipError"; }
